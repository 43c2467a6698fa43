"""Where sandboxes live on the host, and what they may read: ``sandbox_parent()``,
``remove_tree(path)``, ``read_allowlist(site_dirs)``.

Every sandbox's directory is ``<tmp>/rlhf-sandboxes-<uid>/<pid>-<start time>/call-XXXX``: one
directory per process (named so that a reused pid is not mistaken for its predecessor), under one
per user. The first call in a process removes the directories of processes that are gone, so a
trainer killed with SIGKILL (which cannot clean up after itself) leaves nothing once the next
run has started; a process removes its own at exit.

``remove_tree`` removes what a sandbox left without recursion and without raising, whatever the
code made: trees of any depth, names at ``NAME_MAX``, paths past ``PATH_MAX``, directories made
with mode 0 or read-only, symlinks (never followed).

``read_allowlist`` is the Landlock read allowlist (``sandbox.py``, layer 4): the interpreter's
standard library without its ``site-packages``, the site-packages the caller names, the system's
shared libraries, and the few files the loader and the C library open.

Boundaries: the host side only (the parent process); the bootstrap applies the rules.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import stat
import sysconfig
import tempfile
import threading

__all__ = ["read_allowlist", "read_rules", "remove_tree", "sandbox_parent"]

logger = logging.getLogger(__name__)

# What the bootstrap may read besides its working directory, beyond the interpreter's library and
# the site-packages: the loader's and the C library's files, devices that hold no data, and what
# numpy's and OpenMP's thread-count probes read.
_SYSTEM_READ = (
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/localtime",
    "/etc/mime.types",
    "/usr/share/zoneinfo",
    "/usr/lib/locale",
    "/dev/zero",
    "/dev/full",
    "/dev/random",
    "/dev/urandom",
    "/sys/devices/system/cpu",
    "/sys/devices/system/node",
)
# Directories whose entries hold the system's shared libraries; their python* entries (other
# interpreters' libraries and site-packages) are left out.
_SYSTEM_LIB_DIRS = ("/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/local/lib")
_PARENT_LOCK = threading.Lock()


def _stdlib_dirs() -> list[str]:
    return list(dict.fromkeys(os.path.realpath(sysconfig.get_paths()[k]) for k in ("stdlib", "platstdlib")))


def _other_pythons(lib: str) -> list[str]:
    """What the allowlist leaves out of a library directory: another interpreter's library and
    packages (``python*`` in a system library directory; ``site-packages`` in the stdlib)."""
    try:
        names = os.listdir(lib)
    except OSError:
        return []
    if lib in _stdlib_dirs():
        names = [n for n in names if n in ("site-packages", "dist-packages")]
    else:
        names = [n for n in names if n.startswith("python")]
    # Resolved: a symlinked entry is covered (and compared with what must stay visible) as its target.
    return [os.path.realpath(os.path.join(lib, n)) for n in names]


def _library_dirs() -> list[str]:
    return list(dict.fromkeys([*_stdlib_dirs(), *(os.path.realpath(d) for d in _SYSTEM_LIB_DIRS)]))


@functools.lru_cache(maxsize=8)
def read_allowlist(site_dirs: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The paths sandboxed code may read besides its working directory: the interpreter's library
    (without its ``site-packages``), ``site_dirs``, the system's shared libraries (without other
    interpreters' ``python*`` directories) and the few files the loader and Python open
    (``_SYSTEM_READ``). Nothing else: not the checkout, the data, the outputs, ``/tmp``, ``$HOME``
    or ``/proc``. Symlinked duplicates (``/lib`` and ``/usr/lib``) appear once."""
    paths: list[str] = []
    for lib in _library_dirs():
        left_out = set(_other_pythons(lib))
        with contextlib.suppress(OSError):
            entries = [os.path.join(lib, n) for n in os.listdir(lib)]
            paths += [e for e in entries if os.path.realpath(e) not in left_out]
    paths += (os.path.realpath(d) for d in site_dirs)
    paths += _SYSTEM_READ
    return tuple(dict.fromkeys(p for p in paths if os.path.exists(p)))


@functools.lru_cache(maxsize=8)
def read_rules(site_dirs: tuple[str, ...]) -> dict[str, list[str]]:
    """``read_allowlist`` as the bootstrap's Landlock rules, two ways.

    ``read_dirs`` / ``read_files``: one rule per allowed entry of each library directory (a few
    hundred; about 2 ms of every call). ``coarse_dirs`` / ``hide``: one rule per library
    directory, with the left-out ``python*`` and ``site-packages`` directories covered by empty
    read-only tmpfs mounts in the sandbox's own mount namespace, which the bootstrap uses where
    that namespace holds. A left-out directory that holds a named site-packages or the stdlib
    cannot be covered; its library directory keeps its per-entry rules."""
    paths = read_allowlist(site_dirs)
    dirs = [p for p in paths if os.path.isdir(p)]
    files = [p for p in paths if p not in set(dirs)]
    keep = [*_stdlib_dirs(), *(os.path.realpath(d) for d in site_dirs)]
    coarse: list[str] = []
    hide: list[str] = []
    for lib in _library_dirs():
        if not os.path.isdir(lib):
            continue
        covered = _other_pythons(lib)
        if any(k == c or k.startswith(c + "/") for c in covered for k in keep):
            coarse += [p for p in dirs if os.path.dirname(p) == lib]
        else:
            coarse.append(lib)
            hide += covered
    coarse += [p for p in dirs if not any(p == lib or os.path.dirname(p) == lib for lib in _library_dirs())]
    coarse = list(dict.fromkeys(coarse))
    return {
        "read_dirs": dirs,
        "read_files": files,
        "coarse_dirs": coarse,
        "coarse_files": [f for f in files if not any(f.startswith(d + "/") for d in coarse)],
        "hide": [h for h in dict.fromkeys(hide) if os.path.isdir(h)],
    }


def sandbox_parent() -> str:
    """This process's directory of sandboxes, ``<tmp>/rlhf-sandboxes-<uid>/<pid>-<start time>``.
    The first call in a process removes what processes that are gone left there (a trainer killed
    with SIGKILL cannot remove its own)."""
    with _PARENT_LOCK:  # the first calls may come from several of the tool's threads at once
        return _sandbox_parent(tempfile.gettempdir(), os.getpid())


@functools.lru_cache(maxsize=4)
def _sandbox_parent(tmp: str, pid: int) -> str:
    base = os.path.join(tmp, f"rlhf-sandboxes-{os.getuid()}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(base, 0o700)
    st = os.lstat(base)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise OSError(
            f"{base} is not a directory owned by uid {os.getuid()}; remove it or point TMPDIR elsewhere"
        )
    _sweep(base)
    parent = os.path.join(base, f"{pid}-{_start_time(pid)}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(parent, 0o700)
    atexit.register(remove_tree, parent)
    return parent


def _sweep(base: str) -> None:
    """Remove the directories of processes that are gone (``<pid>-<start time>`` names)."""
    for name in os.listdir(base):
        pid, _, started = name.partition("-")
        if pid.isdigit() and _start_time(int(pid)) == started:
            continue  # that process is still running
        removed = remove_tree(os.path.join(base, name))
        logger.info("sandbox: removed %s (%d bytes) left by a process that is gone", name, removed)


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat``), "" when it is
    gone: with the pid, it names one process even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return ""


def remove_tree(path: str) -> int:
    """Remove ``path`` and everything beneath it; returns the bytes its files held. Never raises
    and never recurses: a tree 100,000 directories deep, names at ``NAME_MAX``, directories made
    with mode 0 or read-only, symlinks anywhere (never followed) all go. It walks with one open
    directory at a time (``..`` back up), so neither the stack nor the open files grow with the
    depth. What cannot be removed is logged and left to the next sweep."""
    removed = 0
    try:
        removed = _remove_tree_at(path)
    except FileNotFoundError:
        pass
    except OSError as err:
        logger.warning("sandbox: could not remove %s: %s", path, err)
    return removed


def _remove_tree_at(path: str) -> int:
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
        return st.st_blocks * 512
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = _open_dir(path, flags, None)
    names: list[str] = []  # the directories entered below `path`, outermost first
    removed = 0
    try:
        while True:
            child, freed = _empty_files(fd)
            removed += freed
            if child is not None:
                new_fd = _open_dir(child, flags, fd)
                os.close(fd)
                fd, _ = new_fd, names.append(child)
                continue
            if not names:
                break
            new_fd = os.open("..", flags, dir_fd=fd)
            os.close(fd)
            fd = new_fd
            _make_writable(fd)
            os.rmdir(names.pop(), dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(path)
    return removed


def _open_dir(name: str, flags: int, dir_fd: int | None) -> int:
    """Open a directory to walk it; one made with mode 0 (a non-root user cannot enter it) is
    made accessible first."""
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except PermissionError:
        os.chmod(name, 0o700, dir_fd=dir_fd)  # a directory (O_NOFOLLOW and the lstat said so)
        return os.open(name, flags, dir_fd=dir_fd)


def _make_writable(fd: int) -> None:
    with contextlib.suppress(OSError):
        if os.fstat(fd).st_mode & 0o700 != 0o700:
            os.chmod(fd, 0o700)


def _empty_files(fd: int) -> tuple[str | None, int]:
    """Unlink every non-directory in the directory open at ``fd``; returns the name of one
    subdirectory (None when there is none) and the bytes freed."""
    freed = 0
    _make_writable(fd)  # a read-only directory's entries cannot be unlinked by a non-root user
    with os.scandir(fd) as entries:
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    return entry.name, freed
                blocks = entry.stat(follow_symlinks=False).st_blocks
                os.unlink(entry.name, dir_fd=fd)
                freed += blocks * 512
            except FileNotFoundError:
                continue  # removed by a concurrent sweep
    return None, freed
