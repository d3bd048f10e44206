# SPDX-License-Identifier: Apache-2.0
"""The house drawn from the package's imports (read from the sources with ``ast``: module-level,
inside functions, and under ``TYPE_CHECKING``, since a type-only import is an arrow too): no
import cycle, no arrow up the floors, and the policies' decisions made only by the step.

Floors, lowest first (design: "Folders show the architecture"; the step, which every host calls
once per iteration, sits between the reclamation pieces it drives and the hosts):

    0  the package root, _native, config_base, registry, consistency, report, threads, deprecation
       (import nothing of ours)
    1  core, workloads
    2  reclaim, policies
    3  step
    4  runtime, integration
    5  serving
    6  bench
    7  cli

A module may import from its own floor (another package too) and from the floors below it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import trtllm_vtoken

PACKAGE = Path(trtllm_vtoken.__file__).parent
FLOORS = {
    "": 0, "_native": 0, "config_base": 0, "registry": 0, "consistency": 0, "report": 0, "threads": 0,
    "deprecation": 0,
    "core": 1, "workloads": 1,
    "reclaim": 2, "policies": 2,
    "step": 3,
    "runtime": 4, "integration": 4,
    "serving": 5,
    "bench": 6,
    "cli": 7,
}
DECISIONS = {"select", "select_batch", "observe", "observe_batch"}
"""The policies' decision calls (``EvictionPolicy``): only the step makes them (``step/decide.py``)."""


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__``)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("trtllm_vtoken", *path.relative_to(PACKAGE).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules ``name`` imports, wherever the import statement stands."""
    out = set()
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # a name inside a module: the module
                target = target.rpartition(".")[0]
            if target.startswith("trtllm_vtoken") and target != name:
                out.add(target)
    return out


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(name, path, set(found)) for name, path in found.items()}


def floor(name: str) -> int:
    parts = name.split(".")
    return FLOORS[parts[1] if len(parts) > 1 else ""]


def cycles(edges: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_every_package_has_a_floor():
    packages = {name.split(".")[1] if "." in name else "" for name in modules()}
    assert packages <= set(FLOORS), f"place {sorted(packages - set(FLOORS))} on a floor of FLOORS"


def test_no_import_cycle():
    found = [sorted(c) for c in cycles(graph())]
    assert not found, f"import cycles: {found}"


def test_no_arrow_up_the_floors():
    up = sorted(f"{a} (floor {floor(a)}) -> {b} (floor {floor(b)})"
                for a, targets in graph().items() for b in targets if floor(b) > floor(a))
    assert not up, "imports from a higher floor:\n" + "\n".join(up)


def test_the_cycle_check_sees_a_cycle_and_an_arrow_up():
    """The checks themselves: a cycle through three modules is found, a chain is not."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert floor("trtllm_vtoken.core.token_table") < floor("trtllm_vtoken.step.step") < floor("trtllm_vtoken.cli")


def test_the_step_is_the_only_caller_of_the_policies_decisions():
    """Outside ``policies/`` (which defines them) only ``step/`` calls ``select``/``observe``: every
    host's decisions go through the one batched step."""
    callers = []
    for name, path in modules().items():
        if name.startswith(("trtllm_vtoken.step", "trtllm_vtoken.policies")):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in DECISIONS:
                callers.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} .{node.func.attr}(")
    assert not callers, "policy decisions outside the step:\n" + "\n".join(callers)
