"""`bench`'s contender runner with stand-in contenders: one that runs out of device memory (while building or in a
step) is recorded as such and released, the others finish and are reported, and every built contender is released
exactly once, in both orders (taking turns on CPU; one after the other, as on a GPU)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from appliance.benchmark.contenders import Contender, run_contenders
from appliance.benchmark.workload import Workload
from appliance.hardware import load_hardware
from appliance.planner import load_model_shape, make_plan

OOM_MESSAGE = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB"


class Fake:
    """A contender whose step `fail_at` (counting from 0; None: never) raises torch.OutOfMemoryError."""

    def __init__(self, name: str, released: Counter[str], fail_at: int | None = None) -> None:
        self.name, self.released, self.fail_at, self.steps = name, released, fail_at, 0

    def __call__(self, micro_batches: list) -> None:
        if self.steps == self.fail_at:
            raise torch.OutOfMemoryError(OOM_MESSAGE)
        self.steps += 1

    def release(self) -> None:
        self.released[self.name] += 1


def _workload(interleaved: bool, monkeypatch: pytest.MonkeyPatch) -> Workload:
    spec = make_plan(load_hardware("cpu-laptop-2core"), load_model_shape("bloom-micro-test")).spec()
    monkeypatch.setattr(Workload, "interleaved", property(lambda self: interleaved))
    return Workload(spec=spec, planned={}, micro_batches=1, threads=1, warmup_steps=1, steps=4,
                    device=torch.device("cpu"), quick=True)  # fmt: skip


def _contenders(released: Counter[str], built: dict[str, Fake]) -> list[Contender]:
    def make(name: str, fail_at: int | None = None) -> Fake:
        built[name] = Fake(name, released, fail_at)
        return built[name]

    def no_memory_to_build() -> Fake:
        raise torch.OutOfMemoryError(OOM_MESSAGE)

    return [
        Contender("a", "fine", lambda: make("fine")),
        Contender("b", "fails at step 2", lambda: make("fails at step 2", fail_at=2)),
        Contender("c", "fails to build", no_memory_to_build),
        Contender("d", "also fine", lambda: make("also fine")),
    ]


@pytest.mark.parametrize("interleaved", [True, False], ids=["taking turns", "one after the other"])
def test_out_of_memory_is_recorded_and_the_others_finish(interleaved: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    work = _workload(interleaved, monkeypatch)
    released: Counter[str] = Counter()
    built: dict[str, Fake] = {}
    batches = [[]] * (work.warmup_steps + work.steps)
    outcomes = run_contenders(_contenders(released, built), work, batches, progress=lambda line: None)

    for name in ("fine", "also fine"):
        record = outcomes[name].to_json(work)
        assert record["status"] == "ok" and record["steps_timed"] == work.steps
        assert built[name].steps == len(batches)
    for name in ("fails at step 2", "fails to build"):
        record = outcomes[name].to_json(work)
        assert record == {
            "status": "out_of_memory",
            "micro_batch_size": work.spec.train.micro_batch_size,
            "tokens_per_step": work.tokens_per_step,
            "error": OOM_MESSAGE,
            "peak_memory_gb": None,  # CPU: no device allocator to read
        }
    assert released == {"fine": 1, "fails at step 2": 1, "also fine": 1}  # built ones, each once


def test_a_trainer_out_of_memory_leaves_null_figures_and_peers_on_their_own_weights(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The peers build without the trainer's weights (transformers' own initialisation) and run; the result has no
    tokens/s, ratio or MFU for a trainer that did not run, and the table says so."""
    from appliance.benchmark.command import bench_contenders, bench_result, contender_names
    from appliance.benchmark.contenders import Outcome
    from appliance.benchmark.report import format_table
    from appliance.benchmark.workload import StepTimes

    work = _workload(True, monkeypatch)
    built: dict = {}
    eager = bench_contenders(work, built)[1].build()  # no "trainer" was built
    eager(work.batches()[0])
    assert built["hf_attention"] and "trainer" not in built
    eager.release()

    trainer, hf_eager, hf_compile = contender_names(work)
    outcomes = {
        trainer: Outcome(out_of_memory=OOM_MESSAGE),
        hf_eager: Outcome(StepTimes([0.5, 0.4, 0.6], work.tokens_per_step)),
        hf_compile: Outcome(StepTimes([0.25], work.tokens_per_step)),
    }
    ceiling = {"copy_gbps": 10.0, "matmul_tflops": 0.1, "matmul_dtype": "float32"}
    result = bench_result(work, "test CPU", ceiling, outcomes, kernels=[])
    assert result["tokens_per_s"] is None and result["tflops_per_device"] is None and result["mfu"] is None
    assert result["ratio_vs_hf_eager"] is None and result["ratio_vs_hf_compile"] is None
    assert result["tokens_per_s_hf_eager"] == work.tokens_per_step / 0.5
    assert result["contenders"][trainer]["status"] == "out_of_memory"
    table = format_table(result)
    assert f"{trainer:38s} {'out of memory':>37s}" in table and "CUDA out of memory" in table
