"""Packaging a user can rely on: every package the code imports is pinned in install.sh at the version installed,
pyproject.toml states the same pins, and the wheel holds every package and data file the appliance reads."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INSTALL_SH = ROOT / "install.sh"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
OWN_PACKAGES = ("appliance", "kernels")
# Where the pins sit in install.sh: what the appliance needs at run time, the test tools, and the build tools.
RUNTIME_GROUPS = ("TORCH", "DEEPSPEED", "TRITON", "RUNTIME")
DEV_GROUPS = ("DEV",)
BUILD_GROUPS = ("BUILD",)
# Imported only when present, and never to be installed from the package index: NVIDIA apex is not on it (the
# index's `apex` is an unrelated project), see kernels/registry.py; Dao-AILab's flash-attn, a GPU-only peer in
# `bench`'s kernel table, needs a CUDA build against the installed torch.
OPTIONAL_MODULES = {"apex", "fused_layer_norm_cuda", "flash_attn"}
# Imported only by a command that first checks for it and names the install command, and pinned with the test
# tools (DEV): lm-evaluation-harness, for `eval --tasks` (appliance/eval/lm_eval_tasks.py).
TEST_TOOL_MODULES = {"lm_eval": "lm-eval"}


def canonical(name: str) -> str:
    """A distribution's name as the package index compares them (PEP 503): PyYAML, pyyaml and py_yaml are one."""
    return re.sub(r"[-_.]+", "-", name).lower()


def install_sh_groups() -> dict[str, list[str]]:
    """install.sh's requirement strings by the shell variable holding them: TORCH="..." or RUNTIME=( "..." ... )."""
    groups: dict[str, list[str]] = {}
    current = None
    for line in INSTALL_SH.read_text().splitlines():
        code = line.split("#", 1)[0]  # the why-comments; no requirement contains '#'
        if current is not None:
            groups[current] += re.findall(r'"([^"]+)"', code)
            if ")" in code:
                current = None
        elif match := re.match(r"^([A-Z_]+)=\((.*)$", code):
            groups[match[1]] = re.findall(r'"([^"]+)"', match[2])
            current = None if ")" in match[2] else match[1]
        elif match := re.match(r'^([A-Z_]+)="([^"]*[=<>~!][^"]*)"', code):
            groups[match[1]] = [match[2]]
    return groups


def pins_of(requirements: list[str]) -> dict[str, str]:
    """{canonical name: version} of `name==version` strings; anything looser is no pin and fails here."""
    pins = {}
    for requirement in requirements:
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!-]+)", requirement)
        assert match, f"{requirement!r} is not pinned to one version (name==version)"
        pins[canonical(match[1])] = match[2]
    return pins


def install_sh_pins(group_names: tuple[str, ...]) -> dict[str, str]:
    groups = install_sh_groups()
    missing = [g for g in group_names if g not in groups]
    assert not missing, f"install.sh: no {missing} (the test reads the pins from these variables)"
    return pins_of([r for g in group_names for r in groups[g]])


def imported_top_level_modules() -> dict[str, set[str]]:
    """{module: files importing it}: every `import x` and `from x import y`, at module level or in a function,
    in the appliance's code and its entry point."""
    files = [ROOT / "bloom_appliance.py", *(p for pkg in OWN_PACKAGES for p in sorted((ROOT / pkg).rglob("*.py")))]
    modules: dict[str, set[str]] = {}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                modules.setdefault(name.split(".")[0], set()).add(str(path.relative_to(ROOT)))
    return modules


def test_every_imported_distribution_is_pinned_in_install_sh():
    pinned = install_sh_pins(RUNTIME_GROUPS)
    distributions = importlib.metadata.packages_distributions()
    problems = []
    for module, importers in sorted(imported_top_level_modules().items()):
        if module in sys.stdlib_module_names or module in OWN_PACKAGES or module in OPTIONAL_MODULES:
            continue
        if module in TEST_TOOL_MODULES:
            if TEST_TOOL_MODULES[module] not in install_sh_pins(DEV_GROUPS):
                problems.append(f"{TEST_TOOL_MODULES[module]} (import {module}) is not pinned with the test tools")
            continue
        dists = distributions.get(module)
        where = ", ".join(sorted(importers)[:3])
        if not dists:
            problems.append(f"{module} (imported by {where}) is installed by no distribution")
        elif not any(canonical(d) in pinned for d in dists):
            problems.append(f"{'/'.join(sorted(set(dists)))} (import {module}, in {where}) is not pinned")
    assert not problems, "install.sh's runtime pins lack:\n" + "\n".join(problems)


def test_the_import_scan_sees_function_level_imports():
    """Control for the test above: pyarrow is imported inside a function only, and must still be found."""
    modules = imported_top_level_modules()
    assert "appliance/data/readers.py" in modules["pyarrow"]
    assert "numpy" in modules and "os" in modules


def test_every_pin_is_the_installed_version():
    """A later pip step (e.g. the test tools) must not have replaced a pinned package with another version."""
    pins = install_sh_pins(RUNTIME_GROUPS + DEV_GROUPS + BUILD_GROUPS)
    wrong = {}
    for name, version in pins.items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            installed = "not installed"
        if installed.split("+")[0] != version:  # torch's local label: 2.13.0+cpu is the 2.13.0 release
            wrong[name] = f"pinned {version}, installed {installed}"
    assert not wrong, wrong


def test_pyproject_states_the_pins_of_install_sh():
    project = PYPROJECT["project"]
    assert pins_of(project["dependencies"]) == install_sh_pins(RUNTIME_GROUPS)
    assert pins_of(project["optional-dependencies"]["dev"]) == install_sh_pins(DEV_GROUPS)


def test_console_script_and_version_come_from_the_package():
    target = PYPROJECT["project"]["scripts"]["bloom-appliance"]
    module, _, attr = target.partition(":")
    assert (module, attr) == ("appliance.cli", "main")
    assert callable(getattr(importlib.import_module(module), attr))
    # One place for the version: pyproject reads appliance.__version__, which --version prints.
    assert "version" not in PYPROJECT["project"] and "version" in PYPROJECT["project"]["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "appliance.__version__"}


def test_package_discovery_covers_every_module_and_data_file():
    setuptools = PYPROJECT["tool"]["setuptools"]
    assert setuptools["packages"]["find"]["include"] == [f"{p}*" for p in OWN_PACKAGES]
    for package in OWN_PACKAGES:
        # packages.find (namespaces off) finds a folder of modules only through its __init__.py.
        folders = {p.parent for p in (ROOT / package).rglob("*.py")}
        assert not [f for f in folders if not (f / "__init__.py").exists()], "folders of modules lack __init__.py"
        data = {
            p
            for p in (ROOT / package).rglob("*")
            if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts
        }
        covered = {
            p for pattern in setuptools.get("package-data", {}).get(package, []) for p in (ROOT / package).glob(pattern)
        }
        assert not sorted(data - covered), f"data files the wheel would leave out: {sorted(data - covered)}"
