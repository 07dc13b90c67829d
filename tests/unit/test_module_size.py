"""Small modules with one job: no module outside tests (the appliance, its kernels, its benchmarks) is longer
than MAX_LINES (a file past that is usually two files; docs/ARCHITECTURE.md says where each part lives)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 500
PACKAGES = ("appliance", "kernels", "bench")
# being split: over the limit today, each on its way into smaller modules. Remove an entry once its split lands.
BEING_SPLIT: set[str] = set()


def line_count(path: Path) -> int:
    return len(path.read_text().splitlines())


def long_modules(root: Path) -> dict[str, int]:
    """The modules outside tests (appliance/, kernels/, bench/ and bloom_appliance.py) over MAX_LINES, by path from
    root."""
    paths = [*(p for d in PACKAGES for p in sorted((root / d).rglob("*.py"))), root / "bloom_appliance.py"]
    counts = {str(p.relative_to(root)): line_count(p) for p in paths if p.is_file()}
    return {name: n for name, n in counts.items() if n > MAX_LINES}


def test_no_module_exceeds_the_limit():
    too_long = {name: n for name, n in long_modules(ROOT).items() if name not in BEING_SPLIT}
    assert not too_long, f"over {MAX_LINES} lines (split by concern): {too_long}"


def test_the_allow_list_names_only_modules_still_over_the_limit():
    """An entry whose split has landed goes, so that the module cannot grow back unnoticed."""
    done = sorted(BEING_SPLIT - set(long_modules(ROOT)))
    assert not done, f"at most {MAX_LINES} lines now: remove from BEING_SPLIT: {done}"


def test_the_scan_sees_a_long_module(tmp_path: Path) -> None:
    """Control for the tests above: a module one line over the limit is found, one at the limit is not, and
    kernels/ and bloom_appliance.py count."""
    (tmp_path / "appliance" / "sub").mkdir(parents=True)
    (tmp_path / "appliance" / "sub" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "appliance" / "short.py").write_text("x = 1\n" * MAX_LINES)
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "long.py").write_text("x = 1\n" * (MAX_LINES + 3))
    (tmp_path / "bloom_appliance.py").write_text("x = 1\n" * (MAX_LINES + 2))
    assert long_modules(tmp_path) == {
        "appliance/sub/long.py": MAX_LINES + 1,
        "kernels/long.py": MAX_LINES + 3,
        "bloom_appliance.py": MAX_LINES + 2,
    }
