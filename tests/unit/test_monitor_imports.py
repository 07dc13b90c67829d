"""The monitor modules import each other without a cycle.

Every import counts, also those inside a function or under TYPE_CHECKING: a cycle hidden that way works only as long
as nobody moves an import to the top of a file, and it ties together modules that should each stand alone.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "appliance.monitor"


def imported_modules(path: Path, package: str) -> set[str]:
    """The modules of `package` that the file imports, anywhere in it."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)  # from package import module
    return {name for name in found if name.startswith(package + ".")}


def import_graph(folder: Path, package: str) -> dict[str, set[str]]:
    modules = {f"{package}.{path.stem}": path for path in folder.glob("*.py") if path.stem != "__init__"}
    return {name: imported_modules(path, package) & modules.keys() - {name} for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search, a module on the stack seen again)."""
    done: set[str] = set()

    def visit(name: str, stack: list[str]) -> list[str] | None:
        if name in stack:
            return [*stack[stack.index(name) :], name]
        if name in done:
            return None
        for imported in sorted(graph.get(name, ())):
            cycle = visit(imported, [*stack, name])
            if cycle:
                return cycle
        done.add(name)
        return None

    for start in sorted(graph):
        cycle = visit(start, [])
        if cycle:
            return cycle
    return None


def test_the_monitor_modules_import_each_other_without_a_cycle() -> None:
    graph = import_graph(ROOT / "appliance" / "monitor", PACKAGE)
    assert {"appliance.monitor.energy", "appliance.monitor.gpu", "appliance.monitor.state"} <= graph.keys()
    assert "appliance.monitor.gpu" in graph["appliance.monitor.state"]  # the graph does see the imports
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def test_the_search_finds_the_cycle_the_monitor_had() -> None:
    """energy imported state (for a type) and gpu (inside a function); state imported gpu; gpu imported energy."""
    old = {"energy": {"state", "gpu"}, "state": {"gpu"}, "gpu": {"energy", "events"}, "events": set()}
    assert find_cycle(old) == ["energy", "gpu", "energy"]
    assert find_cycle({**old, "energy": set()}) is None
