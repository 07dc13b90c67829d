"""Launching a plan's ranks: one place computes the rank count and restart budget, and a stale preempted marker
from an earlier stop never makes a later, complete launch look preempted."""

from dataclasses import replace

import appliance.train.launch as launch
from appliance.hardware import load_hardware
from appliance.planner import load_model_shape, make_plan, parse_layout
from appliance.rundir import RunDir
from appliance.train.compile_cache import cache_tag, compile_cache_env


def test_run_plan_starts_tp_pp_dp_ranks_and_clears_a_stale_preempted_marker(tmp_path, monkeypatch):
    run_dir = RunDir(tmp_path / "run").make()
    layout = parse_layout("tp=2,pp=2,dp=2")
    spec = make_plan(load_hardware("cpu-laptop-2core"), load_model_shape("bloom-micro-test"), layout=layout).spec()
    run_dir.plan.write_bytes(replace(spec, run=replace(spec.run, max_restarts=5)).dumps())
    run_dir.preempted_marker.write_text("7\n")  # left by an earlier preempted launch
    seen = {}

    def fake_agent(rd, *, nproc_per_node, max_restarts, worker_args=(), nodes=None, cpu_plan=False):
        seen.update(nproc=nproc_per_node, restarts=max_restarts, args=worker_args, marker=rd.preempted_marker.exists(),
                    cpu_plan=cpu_plan)  # fmt: skip
        return 0

    monkeypatch.setattr(launch, "run_agent", fake_agent)
    assert launch.run_plan(run_dir, worker_args=("--eval-only",)) == 0
    # A CPU plan (cpu-laptop-2core): its ranks see no GPU, even on a GPU node (launch.worker_env)
    assert seen == {"nproc": 8, "restarts": 5, "args": ("--eval-only",), "marker": False, "cpu_plan": True}


def test_agent_command_single_node_hosts_its_rendezvous_on_loopback(tmp_path):
    cmd = launch.agent_command(tmp_path, nproc_per_node=2, max_restarts=3)
    assert cmd[3:5] == ["--host-rendezvous", "127.0.0.1"] and "--standalone" not in cmd  # train/agent.py hosts it
    assert "--nproc-per-node=2" in cmd and "--max-restarts=3" in cmd and "--local-addr=127.0.0.1" in cmd
    assert cmd[-4:] == ["-m", "appliance.rank.worker", "--run-dir", str(tmp_path)]


def test_ranks_keep_their_compile_caches_in_the_run_directory_per_node(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    caches = compile_cache_env(run_dir, node_rank=3)
    env = launch.worker_env({"PATH": "/bin"}, compile_cache=caches)
    assert env["TRITON_CACHE_DIR"] == str(tmp_path / "run" / "compile-cache" / cache_tag() / "node3" / "triton")
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(
        tmp_path / "run" / "compile-cache" / cache_tag() / "node3" / "inductor"
    )
    # A cache the user chose (one for every run of the machine, say) is kept.
    mine = launch.worker_env({"TRITON_CACHE_DIR": "/scratch/triton"}, compile_cache=caches)
    assert (
        mine["TRITON_CACHE_DIR"] == "/scratch/triton"
        and mine["TORCHINDUCTOR_CACHE_DIR"] == env["TORCHINDUCTOR_CACHE_DIR"]
    )


def test_run_agent_gives_the_ranks_the_launch_time_and_the_caches(tmp_path, monkeypatch):
    import time

    run_dir = RunDir(tmp_path / "run").make()
    seen = {}

    class FakeAgent:
        pid = 4242

        def __init__(self, cmd, *, env, **kwargs):
            seen.update(env)

        def wait(self, timeout=None):
            return 0

    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(launch.subprocess, "Popen", FakeAgent)
    before = time.time()
    assert launch.run_agent(run_dir, nproc_per_node=2, max_restarts=0) == 0
    assert before <= float(seen["BLOOM_LAUNCH_TIME"]) <= time.time()
    assert seen["TRITON_CACHE_DIR"] == str(run_dir.compile_cache / cache_tag() / "node0" / "triton")
