"""The package's import graph: no circle between modules, and no import up the layers.

Every import counts: module-level, function-local and ``TYPE_CHECKING`` ones (a lazy import that
closes a circle is still a circle). The layers are the ones ``docs/concepts/architecture.md``
draws; a package may import its own layer and the ones to its left. Also: no worker method is
called by its name as a string (``group.call("update_critic", ...)``): the worker groups' typed
proxies (``group.call.update_critic(...)``) are the only way, so an IDE and a type checker can
follow a step into the workers.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "rlhf_megatron"
ARCHITECTURE = PACKAGE.parent / "docs" / "concepts" / "architecture.md"

# Left to right, as docs/concepts/architecture.md draws them.
LAYERS: tuple[frozenset[str], ...] = tuple(
    frozenset(layer)
    for layer in (
        {"choices", "platform", "algorithms", "agent"},
        {"config"},
        {"planning"},
        {"data", "launch"},
        {"models", "rewards", "scheduling"},
        {"weights", "convert"},
        {"rollout"},
        {"workers"},
        {"trainer"},
        {"train"},
        {"stages"},
        {"sft", "rm", "cli"},
    )
)
OUTSIDE = {"_startup", "__init__"}  # the interpreter-start hook and the package's own __init__


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _targets(module: str, path: Path, node: ast.AST, modules: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = module.split(".")
            if path.name != "__init__.py":
                parts = parts[:-1]
            parts = parts[: len(parts) - node.level + 1]
            base = ".".join([*parts, base] if base else parts)
        names = [
            f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
        ]
    out = []
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name.startswith("rlhf_megatron"):
            out.append(name)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                edges[module].update(t for t in _targets(module, path, node, modules) if t != module)
    return edges


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _layer(top: str) -> int | None:
    return next((i for i, layer in enumerate(LAYERS) if top in layer), None)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_circles():
    assert _cycles(_graph()) == []


def test_every_top_level_entry_has_a_layer_and_a_line_on_the_architecture_page():
    tops = {_top(m) for m in _modules()} - OUTSIDE
    assert {t for t in tops if _layer(t) is None} == set()
    page = ARCHITECTURE.read_text()
    for top in sorted(tops):
        entry = f"`{top}/`" if (PACKAGE / top).is_dir() else f"`{top}.py`"
        assert entry in page, f"{entry} is not named on {ARCHITECTURE.name}"


def test_no_import_runs_up_the_layers():
    up = []
    for module, targets in _graph().items():
        source = _top(module)
        if source in OUTSIDE:
            continue
        for target in targets:
            dest = _top(target)
            if dest not in OUTSIDE and _layer(dest) > _layer(source):
                up.append(f"{module} -> {target}")
    assert up == []


def test_the_checker_sees_function_local_and_type_checking_imports(tmp_path):
    """The graph is built from every import node, wherever it sits."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from rlhf_megatron.trainer import ppo_trainer\n"
        "def f():\n    from rlhf_megatron.workers import actor\n"
    )
    modules = _modules()
    targets = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            targets.update(_targets("rlhf_megatron.algorithms.x", tmp_path / "x.py", node, modules))
    assert targets == {"rlhf_megatron.trainer.ppo_trainer", "rlhf_megatron.workers.actor"}
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


STRING_CALL = re.compile(r"""\.(call|submit)(_within\([^)]*\))?\(\s*["']\w+["']""")


def test_no_worker_method_is_called_by_its_name_as_a_string():
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{n}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if STRING_CALL.search(line)
    ]
    assert found == []
    assert STRING_CALL.search('self.critic.call("update_critic", batch, step)')
    assert not STRING_CALL.search("self.critic.call.update_critic(batch, step)")


def test_the_driver_starts_workers_without_importing_megatron_or_vllm():
    """The driver imports the worker classes only to start them as Ray actors: megatron-core and
    vLLM are the workers' imports (~4-5 s of every CLI start on a 2-core machine otherwise)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import rlhf_megatron.trainer.run\n"
        "from rlhf_megatron.workers import ActorRolloutRefWorker, CriticWorker, RewardModelWorker\n"
        "from rlhf_megatron.workers.rollout import RolloutWorker\n"
        "from rlhf_megatron.workers.judge import build_judge_client\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'megatron', 'vllm'}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
