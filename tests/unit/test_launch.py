"""Launching a plan's ranks: one place computes the rank count and restart budget, and a stale preempted marker
from an earlier stop never makes a later, complete launch look preempted."""

from dataclasses import replace

import appliance.train.launch as launch
from appliance.hardware import load_hardware
from appliance.planner import load_model_shape, make_plan, parse_layout
from appliance.rundir import RunDir


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


def test_agent_command_single_node_uses_a_loopback_standalone_rendezvous(tmp_path):
    cmd = launch.agent_command(tmp_path, nproc_per_node=2, max_restarts=3)
    assert "--standalone" in cmd and "--nproc-per-node=2" in cmd and "--max-restarts=3" in cmd
    assert cmd[-4:] == ["-m", "appliance.train.worker", "--run-dir", str(tmp_path)]
