"""A restarted rank finds what the first start compiled: two processes with the environment the launcher gives the
ranks (train/compile_cache.py compile_cache_env) compile the same function, and the second loads Inductor's FX graph
cache instead of compiling again."""

import json
import subprocess
import sys

import pytest

from appliance.rundir import RunDir
from appliance.train.compile_cache import cache_tag, compile_cache_env, fill_compile_cache_env
from appliance.train.launch import worker_env

pytestmark = pytest.mark.slow

# A small compiled function on CPU (Inductor's C++ path), then Inductor's own counts of FX graph cache hits and misses.
COMPILE_ONCE = """
import json, torch
from torch._dynamo.utils import counters

@torch.compile
def gelu_bias(x, b):
    y = x + b
    return 0.5 * y * (1.0 + torch.tanh(0.79788456 * (y + 0.044715 * y ** 3)))

gelu_bias(torch.randn(8, 16), torch.randn(16))
print(json.dumps(dict(counters["inductor"])))
"""


def compile_in_a_rank(env):
    done = subprocess.run([sys.executable, "-c", COMPILE_ONCE], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_launch_loads_the_first_ones_compiled_graph(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    env = worker_env(compile_cache=compile_cache_env(run_dir))
    for name in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        env[name] = compile_cache_env(run_dir)[name]  # whatever this shell set, the launcher's default is tested
    env.pop("TORCHINDUCTOR_FORCE_DISABLE_CACHES", None)
    first = compile_in_a_rank(env)
    assert first.get("fxgraph_cache_miss", 0) >= 1 and first.get("fxgraph_cache_hit", 0) == 0, first
    assert any((run_dir.compile_cache / cache_tag() / "node0" / "inductor").iterdir())
    again = compile_in_a_rank(env)
    assert again.get("fxgraph_cache_hit", 0) >= 1 and again.get("fxgraph_cache_miss", 0) == 0, again


def test_ranks_whose_launcher_set_no_caches_take_their_nodes_directory(tmp_path):
    """Under the SLURM script every node's agent starts from the batch shell's environment: each rank fills in its
    node's directories from SLURM's node index (else torch's group rank); a variable already set is kept."""
    run_dir = RunDir(tmp_path / "run")
    env = {"SLURM_NODEID": "3", "GROUP_RANK": "1"}
    fill_compile_cache_env(run_dir, env)
    mine = run_dir.compile_cache / cache_tag()
    assert env["TRITON_CACHE_DIR"] == str(mine / "node3" / "triton")
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(mine / "node3" / "inductor")
    env = {"GROUP_RANK": "1", "TRITON_CACHE_DIR": "/shared/triton"}
    fill_compile_cache_env(run_dir, env)
    assert env["TRITON_CACHE_DIR"] == "/shared/triton"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(mine / "node1" / "inductor")
