"""The program the sandbox process runs: harden this process, then run the model's code.

``sandbox.run_python`` compiles this file's source once per process, and each fresh ``python -s
-S -B -c`` loads that code and calls ``main(params)`` (``-S``: the package is not importable
there), so the file must stand alone: standard library only, nothing from this package, nothing
run at import. The parent imports it only to read its source.

``main`` hardens the process before compiling a line of the code, in an order that matters:
rlimits, the network and mount namespaces and the working directory's own tmpfs first (the
seccomp filter forbids ``setrlimit``, ``unshare`` and ``mount`` afterwards), ``no_new_privs``
(Landlock and seccomp require it), Landlock, seccomp, then the audit hook (it refuses ``ctypes``,
which the steps before it use). The layers and what each stops are described in ``sandbox.py``.
"""

import ctypes
import errno
import os
import resource
import struct
import sys
import types

# struct seccomp_data.arch values.
_AUDIT_ARCH_X86_64, _AUDIT_ARCH_AARCH64 = 0xC000003E, 0xC00000B7
# System calls that fail with EPERM, as "name:number" (x86_64, then aarch64, which lacks the
# legacy ones). clone, clone3, kill and tgkill are filtered by their arguments in _seccomp.
_EPERM_X86_64 = (
    "fork:57 vfork:58 execve:59 execveat:322 socket:41 socketpair:53 tkill:200 "
    "rt_sigqueueinfo:129 rt_tgsigqueueinfo:297 ptrace:101 process_vm_readv:310 process_vm_writev:311 "
    "process_madvise:440 process_mrelease:448 pidfd_open:434 pidfd_getfd:438 pidfd_send_signal:424 "
    "kcmp:312 move_pages:279 migrate_pages:256 setrlimit:160 prlimit64:302 setsid:112 setpgid:109 "
    "chmod:90 fchmod:91 fchmodat:268 fchmodat2:452 chown:92 fchown:93 lchown:94 fchownat:260 "
    "setxattr:188 lsetxattr:189 fsetxattr:190 removexattr:197 lremovexattr:198 fremovexattr:199 "
    "setxattrat:463 removexattrat:466 mount:165 umount2:166 pivot_root:155 chroot:161 unshare:272 "
    "setns:308 fsopen:430 fsconfig:431 fsmount:432 fspick:433 move_mount:429 open_tree:428 "
    "mount_setattr:442 open_tree_attr:467 bpf:321 perf_event_open:298 io_uring_setup:425 "
    "io_uring_enter:426 io_uring_register:427 userfaultfd:323 keyctl:250 add_key:248 request_key:249 "
    "init_module:175 finit_module:313 delete_module:176 kexec_load:246 kexec_file_load:320 reboot:169 "
    "swapon:167 swapoff:168 syslog:103 acct:163 settimeofday:164 clock_settime:227 clock_adjtime:305 "
    "adjtimex:159 sethostname:170 setdomainname:171 open_by_handle_at:304 name_to_handle_at:303 "
    "quotactl:179 quotactl_fd:443 fanotify_init:300 mknod:133 mknodat:259 personality:135 "
    "sched_setscheduler:144 sched_setparam:142 sched_setattr:314 setpriority:141 ioprio_set:251 "
    "iopl:172 ioperm:173 modify_ldt:154 uselib:134 _sysctl:156 vhangup:153 lookup_dcookie:212 "
    "nfsservctl:180"
)
_EPERM_AARCH64 = (
    "execve:221 execveat:281 socket:198 socketpair:199 tkill:130 rt_sigqueueinfo:138 "
    "rt_tgsigqueueinfo:240 ptrace:117 process_vm_readv:270 process_vm_writev:271 process_madvise:440 "
    "process_mrelease:448 pidfd_open:434 pidfd_getfd:438 pidfd_send_signal:424 kcmp:272 "
    "move_pages:239 migrate_pages:238 setrlimit:164 prlimit64:261 setsid:157 setpgid:154 fchmod:52 "
    "fchmodat:53 fchmodat2:452 fchown:55 fchownat:54 setxattr:5 lsetxattr:6 fsetxattr:7 "
    "removexattr:14 lremovexattr:15 fremovexattr:16 setxattrat:463 removexattrat:466 mount:40 "
    "umount2:39 pivot_root:41 chroot:51 unshare:97 setns:268 fsopen:430 fsconfig:431 fsmount:432 "
    "fspick:433 move_mount:429 open_tree:428 mount_setattr:442 open_tree_attr:467 bpf:280 "
    "perf_event_open:241 io_uring_setup:425 io_uring_enter:426 io_uring_register:427 userfaultfd:282 "
    "keyctl:219 add_key:217 request_key:218 init_module:105 finit_module:273 delete_module:106 "
    "kexec_load:104 kexec_file_load:294 reboot:142 swapon:224 swapoff:225 syslog:116 acct:89 "
    "settimeofday:170 clock_settime:112 clock_adjtime:266 adjtimex:171 sethostname:161 "
    "setdomainname:162 open_by_handle_at:265 name_to_handle_at:264 quotactl:60 quotactl_fd:443 "
    "fanotify_init:262 mknodat:33 personality:92 sched_setscheduler:119 sched_setparam:118 "
    "sched_setattr:274 setpriority:140 ioprio_set:30 vhangup:58 lookup_dcookie:18 nfsservctl:42"
)
# (arch, EPERM table, clone, clone3, kill, tgkill) per machine.
_SECCOMP_TABLES = {
    "x86_64": (_AUDIT_ARCH_X86_64, _EPERM_X86_64, 56, 435, 62, 234),
    "aarch64": (_AUDIT_ARCH_AARCH64, _EPERM_AARCH64, 220, 435, 129, 131),
}


def main(p: dict) -> None:
    """Harden this process as ``p`` says, then run the code at ``p["code_path"]`` as ``__main__``."""
    with open(p["code_path"], encoding="utf-8", errors="surrogatepass") as f:
        source = f.read()
    layers = _harden(p)
    sys.addaudithook(_audit_hook(p["workdir"], os.getpid()))
    layers["audit_hook"] = True

    sys.path[0:1] = [p["workdir"]]
    sys.path.extend(p["site_dirs"])
    sys.argv = ["<code>"]
    sys.stdout.reconfigure(line_buffering=True)  # what was printed before a timeout is kept
    if p["report"]:
        print(repr(layers))
    _run(source, p["memory_exit"], p["workdir"] if layers["disk_quota"] else None, p["disk_exit"])


def _harden(p: dict) -> dict:
    """Apply every kernel layer this machine has; returns which ones hold."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    # Die with the thread that started us; if it is already gone, stop here.
    _prctl(libc, 1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    if os.getppid() != p["parent_pid"]:
        os._exit(137)
    is_root = os.geteuid() == 0

    _lower(resource.RLIMIT_CPU, p["cpu_s"], p["cpu_s"] + 1)  # SIGXCPU, then SIGKILL a second later
    _lower(resource.RLIMIT_AS, p["memory_bytes"])
    _lower(resource.RLIMIT_FSIZE, p["file_bytes"])
    _lower(resource.RLIMIT_NOFILE, p["nofile"])
    _lower(resource.RLIMIT_CORE, 0)
    _lower(resource.RLIMIT_RTPRIO, 0)
    _lower(resource.RLIMIT_MSGQUEUE, 0)
    netns, mountns = _unshare(libc, is_root)
    layers = {"rlimits": True, "netns": netns}
    layers["disk_quota"] = mountns and _mount_workdir(libc, p)
    # With the left-out directories covered, a library directory is one Landlock rule, not one
    # per entry (hundreds: about 2 ms).
    coarse = layers["disk_quota"] and all(_cover(libc, path) for path in p["hide"])
    read_dirs, read_files = (
        (p["coarse_dirs"], p["coarse_files"]) if coarse else (p["read_dirs"], p["read_files"])
    )
    layers["no_new_privs"] = _prctl(libc, 38, 1) == 0  # PR_SET_NO_NEW_PRIVS
    layers["landlock"] = _landlock(libc, p["workdir"], read_dirs, read_files) if layers["no_new_privs"] else 0
    layers["seccomp"] = _seccomp(libc, os.getpid()) if layers["no_new_privs"] else False
    if not layers["seccomp"] and not is_root:
        _lower(resource.RLIMIT_NPROC, 0)  # no seccomp: at least no new processes (nor threads)
    return layers


def _prctl(libc, option: int, arg2: int = 0, arg3: int = 0) -> int:
    return libc.prctl(
        ctypes.c_int(option), ctypes.c_ulong(arg2), ctypes.c_ulong(arg3), ctypes.c_ulong(0), ctypes.c_ulong(0)
    )


def _syscall(libc, nr: int, *args) -> int:
    return libc.syscall(ctypes.c_long(nr), *args)


def _lower(limit: int, soft: int, hard: int | None = None) -> None:
    """Set an rlimit, never above the hard limit already in place."""
    hard = soft if hard is None else hard
    _, current_hard = resource.getrlimit(limit)
    if current_hard != resource.RLIM_INFINITY:
        soft, hard = min(soft, current_hard), min(hard, current_hard)
    resource.setrlimit(limit, (soft, hard))


def _unshare(libc, is_root: bool) -> tuple[bool, bool]:
    """New network and mount namespaces: ``(network, mount)`` for which held. The network one has
    only a loopback, and it is down. A non-root user gets both inside a new user namespace, where
    the kernel allows those."""
    clone_newnet, clone_newns, clone_newuser = 0x40000000, 0x00020000, 0x10000000
    if is_root:
        netns = libc.unshare(ctypes.c_int(clone_newnet)) == 0
        return netns, libc.unshare(ctypes.c_int(clone_newns)) == 0
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(ctypes.c_int(clone_newuser | clone_newnet | clone_newns)) != 0:
        if libc.unshare(ctypes.c_int(clone_newuser | clone_newnet)) != 0:
            return False, False
        mountns = False
    else:
        mountns = True
    try:  # keep our own uid and gid inside the namespace
        for name, text in (
            ("setgroups", "deny"),
            ("uid_map", f"{uid} {uid} 1"),
            ("gid_map", f"{gid} {gid} 1"),
        ):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    except OSError:
        pass
    return True, mountns


def _mount_workdir(libc, p: dict) -> bool:
    """Mount a tmpfs of ``p["disk_bytes"]`` bytes and ``p["disk_inodes"]`` inodes over the working
    directory, in this process's own mount namespace, and copy the parent's files into it. What
    the code writes never reaches the disk, is bounded as a whole, and is gone with the process.
    Returns whether it holds."""
    ms_nosuid, ms_nodev, ms_noexec, ms_rec, ms_private = 2, 4, 8, 0x4000, 0x40000
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    # Private first: a mount under a shared mount would propagate back to the host's namespace.
    if libc.mount(b"none", b"/", None, ms_rec | ms_private, None) != 0:
        return False
    workdir = p["workdir"]
    staged = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY)  # the parent's files, under the mount
    try:
        options = f"size={p['disk_bytes']},nr_inodes={p['disk_inodes']},mode=0700".encode()
        flags = ms_nosuid | ms_nodev | ms_noexec
        if libc.mount(b"tmpfs", workdir.encode(), b"tmpfs", flags, options) != 0:
            return False
        os.chdir(workdir)  # the old cwd is the directory beneath the mount
        _copy_tree(staged, workdir)
    finally:
        os.close(staged)
    return True


def _cover(libc, path: str) -> bool:
    """Mount an empty read-only tmpfs over ``path`` (in this process's mount namespace only)."""
    ms_rdonly, ms_nosuid, ms_nodev, ms_noexec = 1, 2, 4, 8
    flags = ms_rdonly | ms_nosuid | ms_nodev | ms_noexec
    return libc.mount(b"tmpfs", path.encode(), b"tmpfs", flags, b"size=4k,nr_inodes=2,mode=0555") == 0


def _copy_tree(src_fd: int, dst: str) -> None:
    """Copy the directory open at ``src_fd`` (written by the parent: trusted, shallow) to ``dst``."""
    for entry in os.scandir(src_fd):
        target = os.path.join(dst, entry.name)
        if entry.is_dir(follow_symlinks=False):
            os.mkdir(target, 0o700)
            sub = os.open(entry.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=src_fd)
            try:
                _copy_tree(sub, target)
            finally:
                os.close(sub)
        elif entry.is_file(follow_symlinks=False):
            fd = os.open(entry.name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=src_fd)
            with open(fd, "rb") as src, open(target, "wb") as out:
                while chunk := src.read(1 << 20):
                    out.write(chunk)


class _PathBeneath(ctypes.Structure):
    _pack_ = 1  # struct landlock_path_beneath_attr is packed
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _landlock(libc, workdir: str, read_dirs: list[str], read_files: list[str]) -> int:
    """Reads only beneath ``read_dirs`` and of ``read_files`` (the interpreter's library, the named
    site-packages, the system libraries, a few ``/etc`` files: the parent's allowlist) and the
    working directory; writes only beneath the working directory (and to ``/dev/null``). Returns
    the Landlock ABI version applied, 0 when there is none."""
    abi = _syscall(libc, 444, None, ctypes.c_ulong(0), ctypes.c_ulong(1))  # landlock_create_ruleset(VERSION)
    if abi < 1:
        return 0
    read = 1 | 4 | 8  # EXECUTE, READ_FILE, READ_DIR
    write = 2 | 16 | 32 | 64 | 128 | 256 | 512 | 1024 | 2048 | 4096  # WRITE_FILE, REMOVE_*, MAKE_*
    write |= 8192 if abi >= 2 else 0  # REFER: links and renames across directories
    write |= 16384 if abi >= 3 else 0  # TRUNCATE
    write |= 32768 if abi >= 5 else 0  # IOCTL_DEV
    file_only = 1 | 2 | 4 | 16384 | 32768  # the rights a rule on a file (not a directory) may hold
    net = 1 | 2 if abi >= 4 else 0  # BIND_TCP, CONNECT_TCP: none allowed
    scoped = 1 | 2 if abi >= 6 else 0  # abstract unix sockets and signals stay inside the sandbox
    attr = (ctypes.c_uint64 * 3)(write | read, net, scoped)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    ruleset = _syscall(libc, 444, ctypes.byref(attr), ctypes.c_ulong(size), ctypes.c_ulong(0))
    if ruleset < 0:
        return 0
    # Hundreds of rules: one struct and one argument tuple, reused (a few microseconds a rule).
    rule = _PathBeneath(0, -1)
    add_rule = (
        ctypes.c_long(445),
        ctypes.c_int(ruleset),
        ctypes.c_int(1),
        ctypes.byref(rule),
        ctypes.c_ulong(0),
    )
    syscall, opath = libc.syscall, os.O_PATH | os.O_CLOEXEC

    def allow(paths, access: int) -> bool:
        added = True
        for path in paths:
            try:
                fd = os.open(path, opath)
            except OSError:
                added = False
                continue
            rule.allowed_access, rule.parent_fd = access, fd
            added = syscall(*add_rule) == 0 and added
            os.close(fd)
        return added

    try:
        # Only these two are required; an allowlisted path that cannot be opened stays unreadable.
        ok = allow([workdir], write | read) and allow(["/dev/null"], (read | write) & file_only)
        allow(read_dirs, read)
        allow(read_files, read & file_only)
        return abi if ok and _syscall(libc, 446, ctypes.c_int(ruleset), ctypes.c_ulong(0)) == 0 else 0
    finally:
        os.close(ruleset)


def _seccomp(libc, me: int) -> bool:
    """A seccomp-BPF filter: no new processes (threads only), no sockets, no signals to other
    processes, no system administration (see ``sandbox.py``). Other architectures' system calls
    kill the process. Returns whether it was installed (x86_64 and aarch64 only)."""
    table = _SECCOMP_TABLES.get(os.uname().machine)
    if table is None:
        return False
    arch, eperm_calls, clone, clone3, kill, tgkill = table
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, ... BPF_RET|K
    allow, kill_process, eperm, enosys = 0x7FFF0000, 0x80000000, 0x50001, 0x50026
    arg0 = 16  # offset of the low 32 bits of args[0] in struct seccomp_data (little-endian)

    # (code, jump if true, jump if false, k): load arch, check it, load the system call number.
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, kill_process), (ld, 0, 0, 0)]
    if arch == _AUDIT_ARCH_X86_64:
        prog += [(jge, 0, 1, 0x40000000), (ret, 0, 0, kill_process)]  # x32 system calls
    for item in eperm_calls.split():
        prog += [(jeq, 0, 1, int(item.split(":")[1])), (ret, 0, 0, eperm)]
    # clone3 hides its flags in memory BPF cannot read: ENOSYS makes glibc fall back to clone.
    prog += [(jeq, 0, 1, clone3), (ret, 0, 0, enosys)]
    # clone: threads only (CLONE_THREAD, which the kernel accepts only with CLONE_VM | CLONE_SIGHAND).
    prog += [
        (jeq, 0, 4, clone),
        (ld, 0, 0, arg0),
        (jset, 0, 1, 0x10000),
        (ret, 0, 0, allow),
        (ret, 0, 0, eperm),
    ]
    # kill: only pid 0 (its own group), itself, or its own group (-me).
    prog += [(jeq, 0, 6, kill), (ld, 0, 0, arg0), (jeq, 3, 0, 0), (jeq, 2, 0, me)]
    prog += [(jeq, 1, 0, (-me) & 0xFFFFFFFF), (ret, 0, 0, eperm), (ret, 0, 0, allow)]
    # tgkill: only its own threads.
    prog += [(jeq, 0, 4, tgkill), (ld, 0, 0, arg0), (jeq, 1, 0, me), (ret, 0, 0, eperm), (ret, 0, 0, allow)]
    prog += [(ret, 0, 0, allow)]

    # struct sock_filter {u16 code; u8 jt, jf; u32 k}, packed by hand: hundreds of ctypes
    # structures would cost a millisecond of every call.
    filters = ctypes.create_string_buffer(b"".join(struct.pack("=HBBI", *ins) for ins in prog))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = SockFprog(len(prog), ctypes.addressof(filters))
    return _prctl(libc, 22, 2, ctypes.addressof(fprog)) == 0  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER


def _audit_hook(workdir: str, me: int):
    """A ``sys.addaudithook`` hook that refuses, with a message for the model, what the kernel
    layers stop less clearly (or not at all where they are missing)."""
    # Everything the hook uses is bound here, so patching builtins or modules does not change the
    # checks. The code can still reach the closure's values (a traceback through the hook has its
    # frame, and ``f_locals`` lists them), so each is immutable: strings, frozensets, tuples,
    # read-only mapping proxies, and functions whose code and defaults the hook itself refuses to
    # replace (``object.__setattr__``). gc's object walks and tracing are refused too.
    _type, _str, _bytes, _int = type, str, bytes, int
    _fspath, _getcwd, _readlink = os.fspath, os.getcwd, os.readlink
    refuse = PermissionError
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    prefix = workdir + "/"
    writable = frozenset({"/dev/null", "/dev/stdout", "/dev/stderr", "/dev/fd/1", "/dev/fd/2"})
    processes = (
        "starting processes is not allowed in this sandbox (os.fork, subprocess, multiprocessing, os.system)"
    )
    permissions = "changing file permissions, ownership or attributes is not allowed in this sandbox"
    limits = "changing resource limits is not allowed in this sandbox"
    tampering = "changing the sandbox's own checks is not allowed in this sandbox"
    refused = {
        **{event: f"{event} is not allowed in this sandbox" for event in ("sys.settrace", "sys.setprofile")},
        **{
            f"gc.{name}": f"gc.{name} is not allowed in this sandbox"
            for name in ("get_objects", "get_referrers", "get_referents")
        },
        "resource.setrlimit": limits,
        "resource.prlimit": limits,
        **dict.fromkeys(
            (
                "os.chmod",
                "os.lchmod",
                "os.chown",
                "os.lchown",
                "os.chflags",
                "os.lchflags",
                "os.setxattr",
                "os.removexattr",
                "shutil.chown",
            ),
            permissions,
        ),
        **dict.fromkeys(
            (
                "os.fork",
                "os.forkpty",
                "os.exec",
                "os.posix_spawn",
                "os.spawn",
                "os.system",
                "subprocess.Popen",
                "pty.spawn",
            ),
            processes,
        ),
    }
    # event -> ((path index, dir_fd index or -1), ...) of the paths it writes.
    writes = {
        "os.remove": ((0, 1),),
        "os.rmdir": ((0, 1),),
        "os.mkdir": ((0, 2),),
        "os.rename": ((0, 2), (1, 3)),
        "os.link": ((0, 2), (1, 3)),
        "os.symlink": ((1, 2),),
        "os.truncate": ((0, -1),),
        "os.utime": ((0, 3),),
        "shutil.rmtree": ((0, 1),),
        "shutil.copyfile": ((1, -1),),
        "shutil.copytree": ((1, -1),),
        "shutil.copymode": ((1, -1),),
        "shutil.copystat": ((1, -1),),
        "shutil.move": ((0, -1), (1, -1)),
        "shutil.make_archive": ((0, -1),),
        "sqlite3.connect": ((0, -1),),
    }
    refused, writes = types.MappingProxyType(refused), types.MappingProxyType(writes)

    def resolve(path, dir_fd):
        """The absolute, lexically normalised path; "" when it cannot be known."""
        if _type(path) is _bytes:
            path = path.decode("utf-8", "surrogateescape")
        elif _type(path) is not _str:
            path = _fspath(path)
            if _type(path) is _bytes:
                path = path.decode("utf-8", "surrogateescape")
            elif _type(path) is not _str:
                return ""
        if path[:1] != "/":
            if _type(dir_fd) is _int and dir_fd >= 0:
                try:
                    base = _readlink(f"/proc/self/fd/{dir_fd}")
                except OSError:
                    return ""
            else:
                try:
                    base = _getcwd()
                except OSError:  # past PATH_MAX: where it is cannot be known, so it is not inside
                    return ""
            path = base + "/" + path
        parts = []
        for part in path.split("/"):
            if part == "..":
                if parts:
                    parts.pop()
            elif part and part != ".":
                parts.append(part)
        return "/" + "/".join(parts)

    def inside(path, dir_fd=-1):
        if _type(path) is _int:
            return True  # an open file descriptor
        norm = resolve(path, dir_fd)
        return norm == workdir or norm.startswith(prefix)

    def hook(event, args):
        if event == "open":
            path, flags = args[0], args[2]
            if (
                _type(flags) is _int
                and flags & write_flags
                and not inside(path)
                and resolve(path, -1) not in writable
            ):
                raise refuse(
                    f"writing outside the working directory is not allowed in this sandbox: {path!r}"
                )
            return
        message = refused.get(event)
        if message is not None:
            raise refuse(message)
        if event in ("object.__setattr__", "object.__delattr__"):
            target = args[0]  # by identity: a hostile __eq__ must not run inside the hook
            if target is hook or target is resolve or target is inside:
                raise refuse(tampering)
            return
        if event.startswith("socket."):
            raise refuse("network access is not allowed in this sandbox")
        if event.startswith("ctypes."):
            raise refuse("ctypes is not allowed in this sandbox")
        spec = writes.get(event)
        if spec is not None:
            for path_index, fd_index in spec:
                path = args[path_index]
                if event == "sqlite3.connect" and _type(path) is _str and path in ("", ":memory:"):
                    continue
                if not inside(path, args[fd_index] if fd_index >= 0 else -1):
                    raise refuse(
                        f"{event} outside the working directory is not allowed in this sandbox: {path!r}"
                    )
            if event == "os.symlink":  # the target, relative to the link's directory
                target, link = args[0], resolve(args[1], args[2])
                if _type(target) is _str and target[:1] != "/":
                    target = link.rsplit("/", 1)[0] + "/" + target
                if not inside(target):
                    raise refuse(
                        f"a symlink pointing outside the working directory is not allowed: {args[0]!r}"
                    )
            return
        if event in ("os.kill", "os.killpg"):
            target = args[0]
            if not (_type(target) is _int and target in (0, me, -me)):
                raise refuse("signalling other processes is not allowed in this sandbox")

    return hook


def _run(source: str, memory_exit: int, quota_dir: str | None, disk_exit: int) -> None:
    """Run ``source`` as ``__main__`` and report an uncaught exception as Python would (exit 1),
    a MemoryError with exit status ``memory_exit``, and a full ``quota_dir`` (the working
    directory's tmpfs, where it holds) with ``disk_exit`` whatever the code's own status."""
    import builtins

    module = type(sys)("__main__")
    module.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = module
    failed = out_of_memory = out_of_space = False
    exit_request = None
    try:
        exec(compile(source, "<code>", "exec"), module.__dict__)
    except SystemExit as e:
        exit_request = e
    except BaseException as e:  # everything the code raises is reported as Python would
        failed, out_of_memory = True, isinstance(e, MemoryError)
        out_of_space = isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)
        if out_of_memory:
            module.__dict__.clear()  # free what the code holds before formatting anything
        try:
            import linecache
            import traceback

            linecache.cache["<code>"] = (len(source), None, source.splitlines(True), "<code>")
            tb = e.__traceback__
            while tb is not None and tb.tb_frame.f_code.co_filename == "<string>":
                tb = tb.tb_next  # drop the bootstrap's own frames
            sys.stderr.write("".join(traceback.format_exception(type(e), e, tb)))
        except BaseException:  # still out of memory, or a hostile __str__
            sys.stderr.write(f"{type(e).__name__}\n")
    if out_of_memory:
        _flush_and_exit(memory_exit)
    if quota_dir is not None and (out_of_space or _disk_full(quota_dir)):
        _flush_and_exit(disk_exit)
    if exit_request is not None:
        raise exit_request
    if failed:
        raise SystemExit(1)


def _disk_full(path: str) -> bool:
    """Whether the tmpfs at ``path`` is (all but) full: its last 1% or 1 MiB, or its last inode."""
    try:
        st = os.statvfs(path)
    except BaseException:
        return False
    free = st.f_bavail * st.f_frsize
    return free < min(1 << 20, st.f_blocks * st.f_frsize // 100) or st.f_favail == 0


def _flush_and_exit(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:  # noqa: SIM105 - nothing new to allocate while memory is short
            stream.flush()
        except BaseException:
            pass
    os._exit(code)
