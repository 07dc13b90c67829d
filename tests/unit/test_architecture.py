"""docs/ARCHITECTURE.md stays true: the layers import one way, no two modules import each other (directly or round a
longer loop), and the page names every command, event kind and exit code the code defines. Nothing cites a design
file that is not in the repository."""

from __future__ import annotations

import ast
import re
from collections.abc import Collection
from pathlib import Path

import pytest

from appliance import errors
from appliance.cli import COMMANDS
from appliance.monitor.events import REQUIRED_KEYS

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "ARCHITECTURE.md"
# The one-way flow, first to last: a layer may import itself and the layers before it, never those after it. Every
# package and top-level module of appliance/ has its place ("__init__" is the package's own file, its version), and
# bloom_appliance.py, the command, comes last. kernels/ stands outside the chain: it imports nothing from here.
LAYERS = (
    "__init__",
    "errors",
    "presets",
    "rundir",
    "atomic",
    "output_dirs",
    "process_exit",
    "hardware",
    "monitor",
    "planner",
    "data",
    "tokenizer",
    "model",
    "parallel",
    "preflight",
    "train",
    "eval",
    "rank",
    "benchmark",
    "overrides",
    "stages",
    "tui",
    "run_request",
    "head_run",
    "cli_parser",
    "cli_presets",
    "cli_plan",
    "cli_preflight",
    "cli_data",
    "cli_train",
    "cli_run",
    "cli",
    "bloom_appliance",
)


def module_name(path: Path) -> str:
    """`appliance/train/launch.py` -> `appliance.train.launch`; a package's `__init__.py` is the package."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_files() -> list[Path]:
    """Every module of the appliance and the kernels, and the command that starts them."""
    packages = sorted((ROOT / "appliance").rglob("*.py")) + sorted((ROOT / "kernels").rglob("*.py"))
    return [ROOT / "bloom_appliance.py", *packages]


MODULES = {module_name(p): p for p in source_files()}


def imported_modules(path: Path, known: Collection[str] = MODULES) -> set[str]:
    """The modules of `known` a file imports, at module level and inside functions (TYPE_CHECKING blocks too).
    `from P import n` names module P.n when that is a module, else P, whose file defines n."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found |= {
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module for a in node.names
            }
    return found & set(known)


def layer(module: str) -> str:
    """The entry of LAYERS a module of the appliance belongs to: its package, or its own name at the top level."""
    parts = module.split(".")
    if parts[0] != "appliance":
        return parts[0]
    return parts[1] if len(parts) > 1 else "__init__"


def appliance_imports(path: Path) -> set[str]:
    """The layers a file imports from the appliance."""
    return {layer(m) for m in imported_modules(path) if m.split(".")[0] == "appliance"}


def against_the_flow(imports: dict[str, set[str]]) -> list[str]:
    """`module imports target` for each import of a later layer; `imports`: module -> the modules it imports."""
    order = {name: i for i, name in enumerate(LAYERS)}
    return [f"{module} imports {target}" for module, targets in sorted(imports.items()) for target in sorted(targets)
            if target.startswith("appliance") and order[layer(target)] > order[layer(module)]]  # fmt: skip


def import_graph() -> dict[str, set[str]]:
    return {module: imported_modules(path) - {module} for module, path in MODULES.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted: every cycle lies in one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = [stack.pop()]
            while component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def test_every_package_and_top_level_module_has_a_layer():
    unplaced = sorted({layer(m) for m in MODULES if not m.startswith("kernels")} - set(LAYERS))
    assert not unplaced, f"place each in LAYERS (tests/unit/test_architecture.py) and docs/ARCHITECTURE.md: {unplaced}"


def test_layers_import_only_earlier_layers():
    wrong = against_the_flow({m: targets for m, targets in import_graph().items() if m.split(".")[0] != "kernels"})
    assert not wrong, "against the flow " + " -> ".join(LAYERS) + ":\n" + "\n".join(wrong)


def test_no_file_level_import_cycle():
    cycles = import_cycles(import_graph())
    assert not cycles, "modules that import each other (move what both need below both):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def test_kernels_import_nothing_from_the_appliance():
    wrong = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "kernels").rglob("*.py")) if appliance_imports(p)]
    assert not wrong, wrong


def test_every_import_is_absolute():
    """The scans above read absolute imports only: a relative one would be an edge they cannot see."""
    relative = [f"{p.relative_to(ROOT)}:{n.lineno}" for p in MODULES.values()
                for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.ImportFrom) and n.level]  # fmt: skip
    assert not relative, relative


def test_the_import_scan_sees_function_level_and_from_package_imports():
    """Control for the tests above: real edges of the two kinds the scan must not miss."""
    # BloomForCausalLM builds its MoE layers through an import inside a method.
    assert "appliance.model.moe" in imported_modules(ROOT / "appliance" / "model" / "bloom.py")
    # `from appliance.planner import calibration as cal` is the module calibration.py, not the package.
    device = imported_modules(ROOT / "appliance" / "planner" / "device.py")
    assert "appliance.planner.calibration" in device and "appliance.planner" not in device
    # The rank's entry point imports eval: which is why it sits above both train and eval.
    assert "eval" in appliance_imports(ROOT / "appliance" / "rank" / "worker.py")


def test_the_layer_check_finds_an_import_against_the_flow():
    """Control: the back edge this file once allowed (train imports eval) is reported."""
    graph = import_graph()
    assert not against_the_flow({"appliance.rank.worker": graph["appliance.rank.worker"]})
    assert against_the_flow({"appliance.train.trainer": {"appliance.eval.final", "appliance.model.bloom"}}) == [
        "appliance.train.trainer imports appliance.eval.final"
    ]


def test_the_cycle_check_finds_the_cycles_it_retired():
    """Control: put back a file-level import these modules once made and the real graph has a cycle again."""
    graph = import_graph()
    # Still one way: bloom.py imports moe.py, launch.py imports elastic.py (both inside functions).
    assert "appliance.model.moe" in graph["appliance.model.bloom"]
    assert "appliance.train.elastic" in graph["appliance.train.launch"]
    graph["appliance.model.moe"] = graph["appliance.model.moe"] | {"appliance.model.bloom"}
    graph["appliance.train.elastic"] = graph["appliance.train.elastic"] | {"appliance.train.launch"}
    assert import_cycles(graph) == [
        ["appliance.model.bloom", "appliance.model.moe"],
        ["appliance.train.elastic", "appliance.train.launch"],
    ]
    # A longer cycle is found whole, and a graph without one gives none.
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": {"c"}, "d": {"a", "c"}}) == []


def private_imports(path: Path) -> list[str]:
    """`from appliance.X import _name` in a file: a leading underscore says the name is its module's own."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("appliance"):
            found += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_") and a.name[1:2] != "_"]
    return found


def test_no_module_imports_another_modules_private_names():
    """Shared arithmetic is public API of its module (planner/timing.py's block_seconds), not a private reach-in."""
    wrong = [f"{p.relative_to(ROOT)}: {name}" for p in sorted((ROOT / "appliance").rglob("*.py")) for name in
             private_imports(p)]  # fmt: skip
    assert not wrong, "\n".join(wrong)


def test_the_private_import_scan_sees_one(tmp_path: Path) -> None:
    """Control for the test above: the import this rule retired is one it finds."""
    sample = tmp_path / "sample.py"
    sample.write_text("from appliance.planner.timing import _block, block_seconds\n")
    assert private_imports(sample) == ["appliance.planner.timing._block"]


def doc_section(title: str) -> str:
    """The text under `## title`, up to the next section."""
    match = re.search(rf"^## {title}\n(.*?)(?=^## |\Z)", DOC.read_text(), re.MULTILINE | re.DOTALL)
    assert match, f"{DOC}: no section {title!r}"
    return match[1]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_the_page_lists_every_command(command):
    assert f"| `{command}` |" in doc_section("Commands")


@pytest.mark.parametrize("kind", sorted(REQUIRED_KEYS))
def test_the_page_lists_every_event_kind_with_its_required_keys(kind):
    row = re.search(rf"^\| `{kind}` \|([^|]*)\|", doc_section("Events"), re.MULTILINE)
    assert row, f"no row for event kind {kind!r}"
    for key in REQUIRED_KEYS[kind]:
        assert key in row[1], f"{kind}: required key {key!r} missing from the page"


@pytest.mark.parametrize("name", sorted(n for n in vars(errors) if n.startswith("EXIT_")))
def test_the_page_lists_every_exit_code(name):
    assert f"| {getattr(errors, name)} | `{name}` |" in doc_section("Exit codes")


def test_readme_links_the_page():
    assert "`docs/ARCHITECTURE.md`" in (ROOT / "README.md").read_text()


def test_nothing_cites_a_design_file_outside_the_repository():
    needle = "design" + ".md"  # spelled in two parts so that this file does not match itself
    files = [
        ROOT / "README.md",
        *(p for d in ("appliance", "kernels", "docs", "tests", "bench") for p in (ROOT / d).rglob("*")),
    ]
    citing = [
        str(p.relative_to(ROOT))
        for p in files
        if p.is_file() and p.suffix in (".py", ".md", ".toml", ".tcss", ".yaml") and needle in p.read_text()
    ]
    assert not citing, citing
