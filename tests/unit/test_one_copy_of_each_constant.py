"""One copy of each constant: no two modules of the appliance, the kernels or the benchmarks bind the same
module-level UPPER_CASE name to the same literal value. Such a pair is one fact written twice (a file name, a label
index, a token), which drifts the day one copy changes; the second module imports the first's. Names that only
happen to coincide are listed below with what each means."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("appliance", "kernels", "bench")

# name -> why its copies are different facts that happen to share a value.
DIFFERENT_FACTS = {
    "VERSION": "each file format's own version number (indexed datasets, the metrics snapshot)",
    "SEED": "each one's own random stream: MinHash's permutations (data/dedup.py), a benchmark's weights",
    "RANKS": "each benchmark's own number of gloo ranks",
}


ARITHMETIC = (ast.Constant, ast.BinOp, ast.UnaryOp, ast.operator, ast.unaryop)


def constant_value(expr: ast.expr) -> object | None:
    """A literal's value, or that of arithmetic on numbers alone (`1 << 22`, `2 * 2**30`); None otherwise."""
    try:
        return ast.literal_eval(expr)
    except ValueError:
        pass
    if all(isinstance(node, ARITHMETIC) for node in ast.walk(expr)):
        return eval(compile(ast.Expression(expr), "<constant>", "eval"), {"__builtins__": {}})  # numbers only
    return None


def literal_constants(source: str) -> list[tuple[str, str]]:
    """(name, repr of the value) for each module-level UPPER_CASE name bound to a literal (tuple targets too)."""
    found = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        for target in targets:
            if isinstance(target, ast.Name):
                pairs = [(target, value)]
            elif isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(value.elts) == len(target.elts):
                pairs = list(zip(target.elts, value.elts, strict=True))
            else:
                continue
            for name, expr in pairs:
                if not (isinstance(name, ast.Name) and name.id.isupper()):
                    continue
                value = constant_value(expr)
                if value is not None:  # None: computed from other names, so not a restatement
                    found.append((name.id, repr(value)))
    return found


def scanned_files() -> list[Path]:
    return [path for folder in SCANNED for path in sorted((ROOT / folder).rglob("*.py"))]


def restated_constants() -> dict[tuple[str, str], list[str]]:
    where: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in scanned_files():
        for constant in literal_constants(path.read_text()):
            where[constant].append(str(path.relative_to(ROOT)))
    return {k: v for k, v in where.items() if len(v) > 1 and k[0] not in DIFFERENT_FACTS}


def test_no_constant_is_written_twice():
    twice = restated_constants()
    assert not twice, "\n".join(f"{name} = {value} in {', '.join(files)}" for (name, value), files in twice.items())


def test_the_scan_finds_a_restated_constant():
    """Control: the scan sees plain, annotated and tuple assignments, and skips computed values."""
    source = 'A = "x"\nB: int = 3\nC, D = 1, (2, 3)\nE = len("x")\nlower = 1\nF = 1 << 22\nG = A * 2\n'
    assert literal_constants(source) == [("A", "'x'"), ("B", "3"), ("C", "1"), ("D", "(2, 3)"), ("F", "4194304")]


def test_every_allowed_name_still_has_copies():
    """An entry of DIFFERENT_FACTS whose copies are gone goes too."""
    names: dict[str, set[str]] = defaultdict(set)
    for path in scanned_files():
        for name, _value in literal_constants(path.read_text()):
            names[name].add(str(path))
    for name in DIFFERENT_FACTS:
        assert len(names[name]) > 1, name
