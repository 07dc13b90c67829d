"""install.sh gives a GPU node the CUDA build of the pinned torch, and the CPU build stays where there is no GPU.

No GPU and no package index are needed: install.sh runs in a scratch copy whose `.venv/bin/python` is a stand-in
that logs every call and answers `torch.version.cuda` from a state file, and whose PATH has a stand-in `nvidia-smi`.
What is checked is the decision install.sh takes: which pip commands it runs, with which index, and when it stops.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# The stand-in interpreter. A plain `pip install torch==...` gets $FAKE_DEFAULT_BUILD (what the configured index and
# wheel cache would give); one with --index-url gets $FAKE_INDEX_BUILD. `-c` snippets that ask for torch.version.cuda
# exit 0 only for a CUDA build; every other snippet (import checks, the version banner) succeeds.
FAKE_PYTHON = r"""#!/usr/bin/env bash
here=$(cd "$(dirname "$0")" && pwd)
echo "CALL find_links=[${PIP_FIND_LINKS-unset}] $*" >> "$here/calls.log"
case "$1" in
  --version) echo "Python 3.11.7"; exit 0 ;;
  -c) if [[ "$2" == *torch.version.cuda* ]]; then [[ "$(cat "$here/build" 2>/dev/null)" == cuda ]]; exit; fi; exit 0 ;;
  -m) if [[ "$2 $3" == "pip install" && " $* " == *" torch=="* ]]; then
        if [[ " $* " == *" --index-url "* ]]; then echo "$FAKE_INDEX_BUILD" > "$here/build";
        else echo "$FAKE_DEFAULT_BUILD" > "$here/build"; fi
      fi
      exit 0 ;;
esac
exit 0
"""


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def run_install(
    tmp_path: Path, *, nvidia_smi: str | None, default_build: str, index_build: str, index_url: str | None = None
) -> tuple[int, str, str]:
    """Run a copy of install.sh; returns (exit code, its output, the log of interpreter calls)."""
    for name in ("install.sh", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    venv_bin = tmp_path / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    _executable(venv_bin / "python", FAKE_PYTHON)
    tools = tmp_path / "tools"
    tools.mkdir()
    if nvidia_smi is not None:
        _executable(tools / "nvidia-smi", f"#!/usr/bin/env bash\necho '{nvidia_smi}'\n")
    # A PATH without the real nvidia-smi (if this machine has one): the system's tools, and ours first.
    path = os.pathsep.join([str(tools), "/usr/bin", "/bin"])
    env = {"PATH": path, "HOME": str(tmp_path), "FAKE_DEFAULT_BUILD": default_build, "FAKE_INDEX_BUILD": index_build}
    if index_url is not None:
        env["TORCH_INDEX_URL"] = index_url
    done = subprocess.run(["bash", "install.sh"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    return done.returncode, done.stdout + done.stderr, (venv_bin / "calls.log").read_text()


def _torch_installs(calls: str) -> list[str]:
    return [line for line in calls.splitlines() if "pip install" in line and " torch==" in f"{line} "]


GPU_LISTING = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-2f1c7a9e-0000-0000-0000-000000000000)"


def test_a_cpu_node_takes_the_index_default_once(tmp_path: Path) -> None:
    code, out, calls = run_install(tmp_path, nvidia_smi=None, default_build="cpu", index_build="cuda")
    assert code == 0, out
    assert len(_torch_installs(calls)) == 1
    assert "uninstall" not in calls


def test_nvidia_smi_without_a_gpu_is_a_cpu_node(tmp_path: Path) -> None:
    code, out, calls = run_install(
        tmp_path, nvidia_smi="No devices were found", default_build="cpu", index_build="cuda"
    )
    assert code == 0, out
    assert len(_torch_installs(calls)) == 1


def test_a_gpu_node_given_the_cpu_build_gets_the_cuda_build_from_the_index(tmp_path: Path) -> None:
    code, out, calls = run_install(tmp_path, nvidia_smi=GPU_LISTING, default_build="cpu", index_build="cuda")
    assert code == 0, out
    installs = _torch_installs(calls)
    assert len(installs) == 2, calls
    # The second install asks the package index alone: no local wheel cache that could hand back the CPU build.
    assert "--index-url https://pypi.org/simple" in installs[1] and "find_links=[]" in installs[1]
    assert "pip uninstall --yes" in calls
    assert "CPU-only build; installing the CUDA build" in out


def test_a_gpu_node_that_already_has_the_cuda_build_installs_once(tmp_path: Path) -> None:
    code, out, calls = run_install(tmp_path, nvidia_smi=GPU_LISTING, default_build="cuda", index_build="cuda")
    assert code == 0, out
    assert len(_torch_installs(calls)) == 1


@pytest.mark.parametrize("index_url", [None, "https://mirror.example.invalid/simple"])
def test_a_gpu_node_that_cannot_get_a_cuda_build_stops_and_names_the_fix(tmp_path: Path, index_url: str | None) -> None:
    code, out, calls = run_install(
        tmp_path, nvidia_smi=GPU_LISTING, default_build="cpu", index_build="cpu", index_url=index_url
    )
    assert code == 1
    assert "still a CPU-only build" in out and "TORCH_INDEX_URL" in out
    assert f"--index-url {index_url or 'https://pypi.org/simple'}" in _torch_installs(calls)[-1]
    assert "deepspeed" not in calls  # nothing else is installed on top of the wrong torch
