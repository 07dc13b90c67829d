"""No code from data: nothing in the appliance, the kernels, the benchmarks or the command turns the bytes of a
file into code. A run directory, a checkpoint, a corpus or a download is copied between machines and people, so
reading one must build data and nothing else: no pickle (whose bytes name the callables that rebuild them), no
torch.load that is not weights_only, no numpy object arrays, no YAML tags that construct objects, no eval/exec,
and none of the modules built on those (marshal, shelve, dill...), in code or in the source of a script that code
writes. Multiprocessing may pickle between processes of one run; the one place that unpickles such bytes itself
is listed in ALLOWED with its reason.

The rule reads the source (ast) of every file whose text could hold such a load (MAY_LOAD_CODE: a grep that
only skips the files without one): imports are followed through their aliases (`import numpy as np`, `from torch
import load`), and calls are judged by their keywords wherever their lines break. Code inside string constants
(the scripts and probes written for a subprocess) is matched by pattern.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("appliance", "kernels", "bench")

# Modules whose reading is unpickling (or worse) by design: importing one is the finding.
BANNED_MODULES = {"marshal", "shelve", "dill", "cloudpickle", "jsonpickle", "joblib", "_pickle", "cPickle"}
# Names whose use loads what a file holds as code, whether called or subclassed.
BANNED_NAMES = {
    "pickle.load", "pickle.loads", "pickle.Unpickler", "pickle._Unpickler", "pickle._load", "pickle._loads",
    "pandas.read_pickle", "torch.jit.load", "torch.package.PackageImporter",
    "yaml.unsafe_load", "yaml.unsafe_load_all", "yaml.full_load", "yaml.full_load_all",
    "yaml.Loader", "yaml.UnsafeLoader", "yaml.FullLoader", "yaml.CLoader", "yaml.CUnsafeLoader", "yaml.CFullLoader",
    "eval", "exec", "builtins.eval", "builtins.exec",
}  # fmt: skip
TORCH_LOADS = {"torch.load", "torch.serialization.load"}
YAML_LOADS = {"yaml.load", "yaml.load_all"}
SAFE_YAML_LOADERS = {"yaml.SafeLoader", "yaml.CSafeLoader", "yaml.BaseLoader", "yaml.CBaseLoader"}
# Code in strings: the same loads, spelled as a script would spell them.
IN_STRINGS = re.compile(
    r"\bpickle\.(?:loads?|Unpickler)\b|\b(?:marshal|shelve|dill|cloudpickle|joblib)\b"
    r"|torch\.load\((?![^)]*weights_only=True)|allow_pickle=True|yaml\.(?:unsafe_|full_)load"
    r"|yaml\.load\((?![^)]*Safe)|(?<![\w.])(?:eval|exec)\(|trust_remote_code=True"
)

# A file none of whose words match cannot hold a finding: every banned name is spelled in the file, if only in the
# import that aliases it, and a load of torch or numpy needs the word "load" and the module's name.
MAY_LOAD_CODE = re.compile(
    r"pickle|Unpickler|marshal|shelve|dill|joblib|yaml|trust_remote_code|import_module|__import__|PackageImporter"
    r"|builtins|(?<![\w.])(?:eval|exec)\s*\("
)
LOAD_WORD = re.compile(r"\bload\b")

# (file, rule) -> why the finding is no load of a file.
ALLOWED = {
    ("appliance/parallel/testing.py", "torch.load without weights_only=True"): (
        "run_distributed reads back the results its own spawned gloo ranks put on its multiprocessing queue (which "
        "pickles anyway): bytes from processes it started, never from a file"
    ),
}


def dotted(node: ast.expr, aliases: dict[str, str]) -> str | None:
    """`np.load` -> "numpy.load" (through the file's imports); None for what is not a dotted name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(aliases.get(node.id, node.id))
    return ".".join(reversed(parts))


def keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def is_constant(node: ast.expr | None, value: object) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def call_finding(call: ast.Call, name: str, aliases: dict[str, str]) -> str | None:
    """What is wrong with a call of `name`, or None."""
    if name in TORCH_LOADS and not is_constant(keyword(call, "weights_only"), True):
        return "torch.load without weights_only=True"
    allow_pickle = keyword(call, "allow_pickle")
    if name == "numpy.load" and not (allow_pickle is None or is_constant(allow_pickle, False)):
        return "numpy.load with allow_pickle"
    if name in YAML_LOADS:
        loader = keyword(call, "Loader") or (call.args[1] if len(call.args) > 1 else None)
        if loader is None or dotted(loader, aliases) not in SAFE_YAML_LOADERS:
            return "yaml.load without a safe loader"
    if any(k.arg == "trust_remote_code" and not is_constant(k.value, False) for k in call.keywords):
        return "trust_remote_code (runs code a download holds)"
    if name in ("__import__", "importlib.import_module") and call.args:
        module = call.args[0]
        if isinstance(module, ast.Constant) and str(module.value).split(".")[0] in BANNED_MODULES | {"pickle"}:
            return f"imports {module.value} by name"
    return None


def findings(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """(line, rule) of each way the file turns data into code."""
    tree = ast.parse(path.read_text(encoding="utf-8") if source is None else source, filename=str(path))
    aliases: dict[str, str] = {}
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):  # the imports first: a name is resolved wherever the file uses it
        if isinstance(node, ast.Import):
            for alias in node.names:
                root = alias.name.split(".")[0]  # `import a.b` binds a; `import a.b as c` binds c to a.b
                aliases[alias.asname or root] = alias.name if alias.asname else root
                if root in BANNED_MODULES:
                    found.append((node.lineno, f"imports {alias.name}"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            if node.module.split(".")[0] in BANNED_MODULES:
                found.append((node.lineno, f"imports {node.module}"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Name | ast.Attribute) and isinstance(getattr(node, "ctx", None), ast.Load):
            name = dotted(node, aliases)
            if name in BANNED_NAMES:
                found.append((node.lineno, f"uses {name}"))
        if isinstance(node, ast.Call) and (name := dotted(node.func, aliases)) is not None:
            problem = call_finding(node, name, aliases)
            if problem:
                found.append((node.lineno, problem))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and IN_STRINGS.search(node.value):
            found.append((node.lineno, f"code in a string: {IN_STRINGS.search(node.value).group(0)!r}"))
    return sorted(set(found))


def scanned_files() -> list[Path]:
    return [ROOT / "bloom_appliance.py", *(p for d in SCANNED for p in sorted((ROOT / d).rglob("*.py")))]


def may_load_code(text: str) -> bool:
    return bool(MAY_LOAD_CODE.search(text)) or (bool(LOAD_WORD.search(text)) and ("torch" in text or "numpy" in text))


@functools.cache
def project_findings() -> dict[tuple[str, str], list[int]]:
    out: dict[tuple[str, str], list[int]] = {}
    for path in scanned_files():
        text = path.read_text(encoding="utf-8")
        if not may_load_code(text):
            continue
        for line, rule in findings(path, text):
            out.setdefault((path.relative_to(ROOT).as_posix(), rule), []).append(line)
    return out


def test_nothing_turns_data_into_code() -> None:
    found = project_findings()
    unexplained = [f"{file}:{lines[0]}: {rule}" for (file, rule), lines in found.items() if (file, rule) not in ALLOWED]
    assert not unexplained, "code from data:\n" + "\n".join(unexplained)


def test_every_allowed_finding_is_still_there() -> None:
    """An allowance whose code is gone would wave through the next finding of its kind in that file."""
    found = project_findings()
    assert [key for key in ALLOWED if key not in found] == []


BAD = [
    ("import pickle\npickle.loads(data)", "uses pickle.loads"),
    ("import pickle as p\nobj = p.load(f)", "uses pickle.load"),
    ("from pickle import loads\nloads(data)", "uses pickle.loads"),
    ("import pickle\nclass R(pickle.Unpickler): pass", "uses pickle.Unpickler"),
    ("import torch\ntorch.load(path)", "torch.load without weights_only=True"),
    ("import torch\ntorch.load(\n    path,\n    weights_only=False,\n)", "torch.load without weights_only=True"),
    ("from torch import load\nload(path, map_location='cpu')", "torch.load without weights_only=True"),
    ("import numpy as np\nnp.load(path, allow_pickle=True)", "numpy.load with allow_pickle"),
    ("import numpy\nnumpy.load(path, mmap_mode='r', allow_pickle=flag)", "numpy.load with allow_pickle"),
    ("import yaml\nyaml.load(text)", "yaml.load without a safe loader"),
    ("import yaml\nyaml.load(text, Loader=yaml.Loader)", "yaml.load without a safe loader"),
    ("import yaml\nyaml.unsafe_load(text)", "uses yaml.unsafe_load"),
    ("eval(path.read_text())", "uses eval"),
    ("exec(open(path).read(), {})", "uses exec"),
    ("import builtins\nbuiltins.exec(code)", "uses builtins.exec"),
    ("import marshal", "imports marshal"),
    ("import shelve\nshelve.open(path)", "imports shelve"),
    ("from dill import loads", "imports dill"),
    ("import importlib\nimportlib.import_module('pickle')", "imports pickle by name"),
    ("import transformers as t\nt.AutoModel.from_pretrained(p, trust_remote_code=True)", "trust_remote_code"),
    ("import pandas as pd\npd.read_pickle(path)", "uses pandas.read_pickle"),
    ("PROBE = 'import pickle, sys; pickle.load(open(sys.argv[1], \"rb\"))'", "code in a string"),
    ("SCRIPT = f'torch.load({path!r})'", "code in a string"),
]
GOOD = [
    "import pickle\nkey = hashlib.sha256(pickle.dumps(model)).hexdigest()",
    "import torch\ntorch.load(path, map_location='cpu', weights_only=True)",
    "import torch\ntorch.load(\n    path,\n    weights_only=True,\n)",
    "import numpy as np\nnp.load(path, mmap_mode='r')",
    "import numpy as np\nnp.load(path, allow_pickle=False)",
    "import yaml\nyaml.safe_load(text)",
    "import yaml\nyaml.load(text, Loader=yaml.SafeLoader)",
    "model.eval()\nself.engine.eval()",
    "import torch\nfn = torch.compile(fn)",
    "MESSAGE = 'call module.eval() first'",
    "from appliance.monitor import snapshot_codec\nsnapshot_codec.decode(payload)",
]


@pytest.mark.parametrize(("source", "rule"), BAD)
def test_the_rule_finds_a_planted_load(tmp_path: Path, source: str, rule: str) -> None:
    """Positive control: each bad line, planted in a file, is found (and the project test above would fail)."""
    planted = tmp_path / "planted.py"
    planted.write_text(source + "\n")
    assert may_load_code(source), "the grep would skip the file"
    rules = [found for _, found in findings(planted)]
    assert any(rule in found for found in rules), rules


@pytest.mark.parametrize("source", GOOD)
def test_the_rule_leaves_safe_loads_alone(tmp_path: Path, source: str) -> None:
    planted = tmp_path / "safe.py"
    planted.write_text(source + "\n")
    assert findings(planted) == []
