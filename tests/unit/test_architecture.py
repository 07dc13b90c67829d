"""docs/ARCHITECTURE.md stays true: the layers import one way, and the page names every command, event kind and exit
code the code defines. Nothing cites a design file that is not in the repository."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from appliance import errors
from appliance.cli import COMMANDS
from appliance.monitor.events import REQUIRED_KEYS

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "ARCHITECTURE.md"
# The one-way flow, first to last: a layer may import the layers before it, never those after it.
CHAIN = ("hardware", "planner", "data", "tokenizer", "model", "parallel", "train", "eval", "benchmark")
# The documented back edge: the final evaluation runs inside the ranks that hold the model.
BACK_EDGES = {("train", "eval")}


def appliance_imports(path: Path) -> set[str]:
    """The `appliance.X` packages a file imports (module level and inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        found |= {n.split(".")[1] for n in names if n.startswith("appliance.")}
        found |= {"appliance" for n in names if n == "appliance"}
    return found


def test_layers_import_only_earlier_layers():
    wrong = []
    for i, layer in enumerate(CHAIN):
        later = set(CHAIN[i + 1 :])
        for path in sorted((ROOT / "appliance" / layer).rglob("*.py")):
            for target in sorted(appliance_imports(path) & later):
                if (layer, target) not in BACK_EDGES:
                    wrong.append(f"{path.relative_to(ROOT)} imports appliance.{target}")
    assert not wrong, "against the flow " + " -> ".join(CHAIN) + ":\n" + "\n".join(wrong)


def test_kernels_import_nothing_from_the_appliance():
    wrong = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "kernels").rglob("*.py")) if appliance_imports(p)]
    assert not wrong, wrong


def test_the_import_scan_sees_the_back_edge():
    """Control for the tests above: the allowed back edge is a real, function-level import the scan finds."""
    assert "eval" in appliance_imports(ROOT / "appliance" / "rank" / "worker.py")


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
