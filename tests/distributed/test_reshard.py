"""A checkpoint saved at one layout loads at another: tp2 pp2 dp2 (ZeRO-1) -> tp1 pp2 dp1 (ZeRO-0) -> one process.

One launch per layout, each through the Trainer's own save and load. The first trains a tiny BLOOM for 3 steps
and saves; the next loads that checkpoint, saves it again at its own layout and trains steps 4 and 5; the single
process does the same from the second one's checkpoint. The saves are gathered here, in the test process, into
whole tensors. The first launch also resumes at its own layout into fresh engines, in fp32 and in bf16 with
DeepSpeed's bf16 optimizer (ZeRO-1), and a bf16 checkpoint travels the same way as the fp32 one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import reference_training
import torch
from noise_floor import NoiseFloor, Order, assert_within, check_floor, measure_floor
from reference_training import Recipe
from safetensors import safe_open
from safetensors.torch import save_file

from appliance.data.sampler import PretrainingSampler
from appliance.model.config import BloomConfig
from appliance.monitor.events import EventWriter
from appliance.parallel.checkpoint.optimizer_state import optimizer_files
from appliance.parallel.checkpoint.weight_shards import ShardReader, model_sources
from appliance.parallel.step.build import build_engine
from appliance.parallel.tensor.param_splits import role_of_parameter, shard_from_full
from appliance.parallel.testing import engine_layout, run_distributed
from appliance.parallel.topology import ParallelTopology
from appliance.rundir import RunDir
from appliance.train import checkpoint as ckpt
from appliance.train.metrics import StepFlops
from appliance.train.settings import TrainSettings, lr_schedule
from appliance.train.trainer import Trainer

pytestmark = pytest.mark.distributed

CONFIG = BloomConfig(vocab_size=256, hidden_size=64, n_layer=2, n_head=4)  # 256 = 128 x tp(2)
SEQ, MBS, GBS, SAMPLES = 16, 2, 8, 64
SAVE_AT, BF16_SAVE_AT = 3, 2
AFTER = 2  # steps trained after a load: the second one's loss depends on the loaded Adam state
# The layouts sum in other orders than one another (see noise_floor.py), so the steps after the load differ by
# the noise floor of those steps, measured on the single-process reference of this run; each layout lies within
# a few floors of the reference (test_3d_equivalence measures up to 3.6 x), so two of them within 10 x.
FACTOR = 10.0
ORIGINAL, SMALLER, SINGLE = (2, 2, 2), (1, 2, 1), (1, 1, 1)  # (tp, pp, dp)


class TokenStream:
    """Samples of SEQ + 1 tokens: arithmetic progressions mod 200 with a per-sample start and stride."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        start, stride = torch.randint(0, 200, (SAMPLES, 1), generator=g), torch.randint(1, 7, (SAMPLES, 1), generator=g)
        self.tokens = ((start + stride * torch.arange(SEQ + 1)) % 200).numpy()

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> np.ndarray:
        return self.tokens[i]


def _settings(dtype: str) -> TrainSettings:
    return TrainSettings(
        seq_len=SEQ,
        global_batch_size=GBS,
        micro_batch_size=MBS,
        train_samples=SAMPLES,
        lr=1e-2,
        min_lr=1e-3,
        warmup_samples=8,
        decay_samples=64,
        weight_decay=0.1,
        grad_clip=0.5,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_eps=1e-8,
        eval_interval=1000,
        eval_samples=0,
        save_interval=1000,
        dtype=dtype,
        seed=1234,
        keep_last=10,
    )


def _trainer(topology: ParallelTopology, root: Path, zero: int, dtype: str = "fp32") -> Trainer:
    """A Trainer as the worker builds it, at this launch's layout, with ``root`` as its run directory."""
    os.environ.setdefault("LOCAL_RANK", "0")  # read by DeepSpeed's PipelineModule
    settings = _settings(dtype)
    # The engine reads the settings the trainer reads, as the worker's does (train/from_spec.py).
    planned = engine_layout(topology, micro_batch_size=MBS, global_batch_size=GBS, zero_stage=zero, recompute="none")
    engine = build_engine(CONFIG, topology, planned, settings, hardware=None)
    rank = torch.distributed.get_rank()
    data = TokenStream()

    def micro_batches(consumed: int) -> Any:
        return iter(PretrainingSampler(len(data), consumed, MBS, engine.dp_rank, topology.dp))

    run_dir = RunDir(root)
    root.mkdir(parents=True, exist_ok=True)
    layout = {"tp": topology.tp, "pp": topology.pp, "dp": topology.dp, "micro_batch_size": MBS, "zero_stage": zero}
    return Trainer(
        engine=engine,
        settings=settings,
        train_data=data,
        valid_data={},
        micro_batches=micro_batches,
        run_dir=run_dir,
        rank=rank,
        dp_rank=engine.dp_rank,
        dp_size=topology.dp,
        world_size=topology.world_size,
        events=EventWriter(run_dir.metrics) if rank == 0 else None,
        flops=StepFlops(model=1.0, hardware=1.0),
        peak_flops_per_device=None,
        layout=layout,
        versions={},
        device=torch.device("cpu"),
    )


def _steps(trainer: Trainer, count: int) -> list[tuple[float, float]]:
    """(loss, grad norm) of the next ``count`` steps, continuing from the trainer's data position."""
    batches = trainer.micro_batches(trainer.pos.consumed_samples)
    out = []
    for _ in range(count):
        result = trainer.train_step(batches)
        assert result is not None
        out.append((result["loss"], result["grad_norm"]))
    return out


def _step_dir(root: Path, step: int) -> Path:
    return root / "checkpoints" / ckpt.step_dir_name(step)


# ---- the launches ------------------------------------------------------------------------------------------
def original_layout(topology: ParallelTopology, root: Path) -> dict[str, Any]:
    trainer = _trainer(topology, root / "a", zero=1)
    _steps(trainer, SAVE_AT)
    trainer.save()
    out: dict[str, Any] = {"next": _steps(trainer, AFTER)}
    fresh = _trainer(topology, root / "a", zero=1)
    fresh.load(_step_dir(root / "a", SAVE_AT))
    out["resumed"] = _steps(fresh, AFTER)
    bf16 = _trainer(topology, root / "bf16-a", zero=1, dtype="bf16")
    _steps(bf16, BF16_SAVE_AT)
    bf16.save()
    out["bf16_next"] = _steps(bf16, AFTER)
    bf16_fresh = _trainer(topology, root / "bf16-a", zero=1, dtype="bf16")
    bf16_fresh.load(_step_dir(root / "bf16-a", BF16_SAVE_AT))
    out["bf16_resumed"] = _steps(bf16_fresh, AFTER)
    return out


def resharded(topology: ParallelTopology, root: Path, source: str, target: str, zero: int) -> dict[str, Any]:
    """Load ``source``'s checkpoints at this layout, save them again under ``target``, train the next step."""
    trainer = _trainer(topology, root / target, zero=zero)
    trainer.load(_step_dir(root / source, SAVE_AT))
    out: dict[str, Any] = {"position": (trainer.pos.step, trainer.pos.consumed_samples)}
    trainer.save()
    out["next"] = _steps(trainer, AFTER)
    bf16 = _trainer(topology, root / f"bf16-{target}", zero=1, dtype="bf16")
    bf16.load(_step_dir(root / f"bf16-{source}", BF16_SAVE_AT))
    bf16.save()
    return out


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("reshard")
    out: dict[str, Any] = {"root": root}
    tp, pp, dp = ORIGINAL
    out["a"] = run_distributed(original_layout, tp * pp * dp, root, tp=tp, pp=pp, dp=dp, timeout_s=400)
    tp, pp, dp = SMALLER
    out["b"] = run_distributed(resharded, tp * pp * dp, root, "a", "b", 0, tp=tp, pp=pp, dp=dp, timeout_s=200)
    out["c"] = run_distributed(resharded, 1, root, "b", "c", 1, timeout_s=200)
    return out


def gathered(step_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, weights and optimizer state, whole (as one process would hold it)."""
    out = {}
    model = ShardReader(model_sources(step_dir), what=str(step_dir))
    for name in model:
        out[name] = model.read(name, name, 0, 1)
    optimizer = ShardReader(optimizer_files(step_dir), what=str(step_dir))
    for key in optimizer:
        out[key] = optimizer.read(key, key.rsplit(".", 1)[0], 0, 1)
    return out


def reference_run(order: Order) -> dict[str, Any]:
    """The single-process reference of the first launch's run (SAVE_AT + AFTER steps of GBS samples); its trace
    is the losses and grad norms of the steps after the save."""
    settings = _settings("fp32")
    recipe = Recipe(
        config=CONFIG,
        seed=settings.seed,
        micro_batch_size=MBS,
        steps=[(step * GBS, GBS) for step in range(SAVE_AT + AFTER)],
        lr_at=lr_schedule(settings).at,
        weight_decay=settings.weight_decay,
        betas=(settings.adam_beta1, settings.adam_beta2),
        eps=settings.adam_eps,
        grad_clip=settings.grad_clip,
    )
    _, trace = reference_training.train(recipe, torch.from_numpy(TokenStream().tokens), order)
    return {"losses": trace["losses"][SAVE_AT:], "norms": trace["norms"][SAVE_AT:]}


@pytest.fixture(scope="module")
def floor() -> NoiseFloor:
    return measure_floor(reference_run)[1]


def _assert_same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], where: str) -> None:
    assert got.keys() == want.keys(), (where, sorted(got.keys() ^ want.keys()))
    for key, tensor in want.items():
        assert torch.equal(got[key], tensor), (where, key)


# ---- the checks ----------------------------------------------------------------------------------------------
def test_weights_and_adam_state_gathered_equal_exactly_at_every_layout(launches: dict[str, Any]) -> None:
    root = launches["root"]
    original = gathered(_step_dir(root / "a", SAVE_AT))
    names = [k for k in original if k.endswith((".weight", ".bias"))]
    assert names and all(f"{n}.exp_avg" in original and f"{n}.exp_avg_sq" in original for n in names)
    assert all(int(original[f"{n}.step"]) == SAVE_AT for n in names)
    assert all(float(original[f"{n}.exp_avg_sq"].abs().max()) > 0 for n in names)  # trained state, not zeros
    _assert_same_state(gathered(_step_dir(root / "b", SAVE_AT)), original, "tp1 pp2 dp1")
    _assert_same_state(gathered(_step_dir(root / "c", SAVE_AT)), original, "single process")


def test_tied_embedding_state_is_the_same_in_both_pipeline_stages(launches: dict[str, Any]) -> None:
    """The loader reads the tied word embedding's state from the first stage: the last stage holds the same."""
    files = optimizer_files(_step_dir(launches["root"] / "a", SAVE_AT))
    key = "transformer.word_embeddings.weight.exp_avg"
    copies: dict[tuple[int, int], torch.Tensor] = {}
    for t, p, path in files:
        with safe_open(str(path), framework="pt") as f:
            if key in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                copies[(t, p)] = f.get_tensor(key)
    assert sorted(copies) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(torch.equal(copies[(t, 0)], copies[(t, 1)]) for t in range(2))


def test_consumed_samples_and_step_are_kept(launches: dict[str, Any]) -> None:
    root = launches["root"]
    want = ckpt.read_manifest(_step_dir(root / "a", SAVE_AT))
    assert want is not None and want["consumed_samples"] == SAVE_AT * GBS
    for target in ("b", "c"):
        manifest = ckpt.read_manifest(_step_dir(root / target, SAVE_AT), verify_hashes=True)
        assert manifest is not None
        assert (manifest["step"], manifest["consumed_samples"]) == (SAVE_AT, want["consumed_samples"])
        assert all(r["position"] == (SAVE_AT, SAVE_AT * GBS) for r in launches[target])


def test_noise_floor_of_the_steps_after_the_load_is_nonzero_but_small(floor: NoiseFloor) -> None:
    check_floor(floor, ["losses", "norms"])


def test_steps_after_resharding_match_the_original_layout_within_the_noise_floor(
    launches: dict[str, Any], floor: NoiseFloor
) -> None:
    """Losses and grad norms of the two steps after the load; the second one's loss follows an Adam update made
    with the loaded moments and step count."""
    want = launches["a"][0]["next"]
    for target in ("b", "c"):
        for rank, result in enumerate(launches[target]):
            for i, key in enumerate(("losses", "norms")):
                got, expected = [s[i] for s in result["next"]], [s[i] for s in want]
                assert_within(got, expected, key, floor, FACTOR, f"layout {target} rank {rank} {key}")


def test_same_layout_resume_fp32_zero1_is_bit_for_bit(launches: dict[str, Any]) -> None:
    for result in launches["a"]:
        assert result["resumed"] == result["next"]


def test_same_layout_resume_bf16_zero1_is_bit_for_bit(launches: dict[str, Any]) -> None:
    for result in launches["a"]:
        assert result["bf16_resumed"] == result["bf16_next"]


def test_bf16_masters_and_moments_gathered_equal_exactly_after_resharding(launches: dict[str, Any]) -> None:
    root = launches["root"]
    original = gathered(_step_dir(root / "bf16-a", BF16_SAVE_AT))
    masters = [k for k in original if k.endswith(".master")]
    assert len(masters) == len([k for k in original if k.endswith(".exp_avg")]) > 0
    # The masters hold what bf16 weights round away.
    assert any(not torch.equal(original[m], original[m.removesuffix(".master")]) for m in masters)
    _assert_same_state(gathered(_step_dir(root / "bf16-b", BF16_SAVE_AT)), original, "bf16 tp1 pp2 dp1")
    _assert_same_state(gathered(_step_dir(root / "bf16-c", BF16_SAVE_AT)), original, "bf16 single process")


def test_layout_change_is_a_warning_event_naming_both_layouts(launches: dict[str, Any]) -> None:
    events = [json.loads(line) for line in (launches["root"] / "b" / "metrics.jsonl").read_text().splitlines()]
    messages = [e["message"] for e in events if e["kind"] == "warning"]
    assert any("tp=2,pp=2,dp=2 -> tp=1,pp=2,dp=1" in m for m in messages), messages
    same_layout = (launches["root"] / "a" / "metrics.jsonl").read_text()
    assert '"warning"' not in same_layout


def test_shard_reader_cuts_any_tp_slice_from_pieces_of_another_tp(tmp_path: Path) -> None:
    """Pieces written at tp=4 (a position's tensors spread over two files) read back as shard_from_full's slices
    at tp 1, 2 and 4, for a split-by-rows, a split-by-columns, a replicated and a 0-d tensor."""
    g = torch.Generator().manual_seed(0)
    full = {
        "transformer.h.0.self_attention.query_key_value.weight": torch.randn(24, 8, generator=g),
        "transformer.h.0.mlp.dense_4h_to_h.weight": torch.randn(8, 32, generator=g),
        "transformer.h.0.input_layernorm.weight": torch.randn(8, generator=g),
    }
    full["transformer.h.0.mlp.dense_4h_to_h.weight.step"] = torch.tensor(7)
    sources = []
    for t in range(4):
        pieces = {}
        for key, tensor in full.items():
            name = key.removesuffix(".step")
            pieces[key] = tensor if tensor.ndim == 0 else _cut(tensor, name, t, 4)
        keys = sorted(pieces)
        for half, part in enumerate((keys[:2], keys[2:])):
            path = tmp_path / f"tp{t}-{half}.safetensors"
            save_file({k: pieces[k].contiguous() for k in part}, str(path), metadata={"tp": "4"})
            sources.append((t, 0, path))
    reader = ShardReader(sources, what="pieces")
    assert reader.tp == 4 and set(reader.keys()) == set(full)
    for tp_size in (1, 2, 4):
        for tp_rank in range(tp_size):
            for key, tensor in full.items():
                name = key.removesuffix(".step")
                want = tensor if tensor.ndim == 0 else _cut(tensor, name, tp_rank, tp_size)
                assert torch.equal(reader.read(key, name, tp_rank, tp_size), want), (key, tp_rank, tp_size)


def _cut(tensor: torch.Tensor, name: str, tp_rank: int, tp_size: int) -> torch.Tensor:
    role, is_bias = role_of_parameter(name)
    return shard_from_full(tensor, role, tp_rank, tp_size, is_bias=is_bias)
