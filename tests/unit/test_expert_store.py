"""The tiered expert store trains bit for bit like the all-resident model.

A 4-layer MoE stack of 4 BLOOM-MLP experts each (DeepSpeed's Experts container, fixed routing) trains 3 steps of 2
micro-batches with torch's AdamW (foreach=False) over every parameter: the reference. The same model then trains
with its experts in the store, under a device budget of 2 layers' experts and a host budget of 2 experts, so
experts move device -> host -> disk and back within every step (gradients between micro-batches included). The
arithmetic of each op is unchanged (same shapes, same order, same CPU kernels), only where the weights wait between
uses, so losses, outputs, gradients and updated weights and AdamW state must be torch.equal, not merely close.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from appliance.errors import BadInput
from appliance.monitor.events import make_event
from appliance.monitor.state import RunState, reduce
from appliance.overrides import parse_overrides
from appliance.parallel.experts.store import (
    ExpertStore,
    expert_step_fields,
    expert_store_for_run,
    expert_tier_event,
)
from appliance.parallel.experts.store_hooks import attach_expert_store
from appliance.parallel.experts.store_slots import AdamWSettings
from appliance.parallel.experts.store_stand_in import MoeStack, dense_parameters
from appliance.planner.train_settings import TrainSettings
from appliance.rundir import RunDir

HIDDEN, EXPERTS, LAYERS = 8, 4, 4
TOKENS = 16  # a micro-batch of 2 x 8 tokens: 4 per expert
STEPS, MICRO_BATCHES = 3, 2
ADAMW = AdamWSettings(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
LRS = (1e-2, 5e-3, 2e-3)  # a schedule: the store must take each step's lr


def batches() -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(1)
    return [
        [(torch.randn(2, 8, HIDDEN, generator=g), torch.randn(2, 8, HIDDEN, generator=g)) for _ in range(MICRO_BATCHES)]
        for _ in range(STEPS)
    ]


def adamw(params: list[torch.nn.Parameter]) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        params, lr=ADAMW.lr, betas=ADAMW.betas, eps=ADAMW.eps, weight_decay=ADAMW.weight_decay, foreach=False
    )


def expert_name(layer: int, index: int, name: str) -> str:
    return f"blocks.{layer}.experts.deepspeed_experts.{index}.{name}"


def train_reference() -> dict:
    model = MoeStack(HIDDEN, EXPERTS, LAYERS)
    optimizer = adamw(list(model.parameters()))
    record: dict = {"outputs": [], "grads": [], "expert_norm_sq": []}
    for step, micro_batches in enumerate(batches()):
        for x, target in micro_batches:
            out = model(x)
            ((out - target) ** 2).mean().backward()
            record["outputs"].append(out.detach().clone())
        record["grads"].append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        experts = [p for layer in model.expert_layers() for expert in layer for p in expert.parameters()]
        record["expert_norm_sq"].append(sum(float(p.grad.double().pow(2).sum()) for p in experts))
        for group in optimizer.param_groups:
            group["lr"] = LRS[step]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    state = {n: optimizer.state[p] for n, p in model.named_parameters()}
    record["weights"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    record["exp_avg_sq"] = {n: s["exp_avg_sq"].clone() for n, s in state.items()}
    return record


def train_tiered(disk_dir: Path, device_budget: int | None, host_budget: int | None) -> tuple[dict, ExpertStore]:
    model = MoeStack(HIDDEN, EXPERTS, LAYERS)
    store = ExpertStore(
        model.expert_layers(),
        device="cpu",
        device_budget_bytes=device_budget,
        host_budget_bytes=host_budget,
        disk_dir=disk_dir,
        adamw=ADAMW,
    )
    attach_expert_store(store, model.expert_containers())
    dense = adamw(dense_parameters(model))
    dense_names = {id(p): n for n, p in model.named_parameters()}
    record: dict = {"outputs": [], "grads": [], "placements": [], "expert_norm_sq": [], "pinned": 0}
    for step, micro_batches in enumerate(batches()):
        for x, target in micro_batches:
            out = model(x)
            ((out - target) ** 2).mean().backward()
            record["outputs"].append(out.detach().clone())
            record["pinned"] += sum(slot.pinned for slot in store.slots.values())  # all released by backward
        grads = {dense_names[id(p)]: p.grad.clone() for p in dense_parameters(model) if p.grad is not None}
        for (layer, index), _ in store.slots.items():
            tensors = store.read_expert((layer, index))
            grads.update({expert_name(layer, index, n[:-5]): t for n, t in tensors.items() if n.endswith(".grad")})
        record["grads"].append(grads)
        record["expert_norm_sq"].append(store.grad_norm_sq())
        record["placements"].append(store.placement())
        for group in dense.param_groups:
            group["lr"] = LRS[step]
        dense.step()
        dense.zero_grad(set_to_none=True)
        store.step(lr=LRS[step])
    record["weights"] = {dense_names[id(p)]: p.detach().clone() for p in dense_parameters(model)}
    record["exp_avg_sq"] = {dense_names[id(p)]: dense.state[p]["exp_avg_sq"].clone() for p in dense_parameters(model)}
    for layer, index in store.slots:
        for name, tensor in store.read_expert((layer, index)).items():
            base, _, suffix = name.rpartition(".")
            if suffix == "step":
                continue
            if suffix == "exp_avg_sq":
                record["exp_avg_sq"][expert_name(layer, index, base)] = tensor
            elif not name.endswith((".grad", ".exp_avg")):
                record["weights"][expert_name(layer, index, name)] = tensor
    return record, store


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    expert_bytes = ExpertStore(MoeStack(HIDDEN, EXPERTS, 1).expert_layers(), device="cpu").slots[(0, 0)].nbytes
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: a second thread only contends (10x slower on a loaded 2-core machine)
    try:
        tiered, store = train_tiered(tmp_path_factory.mktemp("disk"), 2 * EXPERTS * expert_bytes, 2 * expert_bytes)
        reference = train_reference()
    finally:
        torch.set_num_threads(threads)
    return {"reference": reference, "tiered": tiered, "store": store, "expert_bytes": expert_bytes}


def assert_all_equal(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for name in want:
        assert torch.equal(got[name], want[name]), f"{what}: {name} differs"


def test_tiered_training_is_bitwise_the_all_resident_training(runs: dict) -> None:
    reference, tiered = runs["reference"], runs["tiered"]
    for i, (got, want) in enumerate(zip(tiered["outputs"], reference["outputs"], strict=True)):
        assert torch.equal(got, want), f"micro-batch {i}: outputs differ"
    for step, (got, want) in enumerate(zip(tiered["grads"], reference["grads"], strict=True)):
        assert_all_equal(got, want, f"step {step} gradients")
    assert_all_equal(tiered["weights"], reference["weights"], "updated weights")
    assert_all_equal(tiered["exp_avg_sq"], reference["exp_avg_sq"], "AdamW exp_avg_sq")
    # clipping's share: the same squares summed in the same order, read where each expert waits
    assert tiered["expert_norm_sq"] == reference["expert_norm_sq"]
    assert tiered["pinned"] == 0  # each expert is free to leave once its gradients are in
    # The point of the budget: experts did wait in every tier
    assert all(p["disk"] > 0 and p["host"] > 0 and p["device"] <= 2 * EXPERTS for p in tiered["placements"])


def test_counters_count_whole_expert_moves(runs: dict) -> None:
    c, b = runs["store"].counters(), runs["expert_bytes"]
    device, host, disk = c["device"], c["host"], c["disk"]
    assert device["hits"] > 0 and host["fetches"] > 0 and disk["fetches"] > 0
    assert device["evictions"] > 0 and host["evictions"] > 0
    assert device["bytes_in"] == (host["fetches"] + disk["fetches"]) * b
    assert device["bytes_out"] == host["bytes_in"] == device["evictions"] * b
    assert host["bytes_out"] == (host["fetches"] + host["evictions"]) * b
    assert disk["bytes_in"] == host["evictions"] * b and disk["bytes_out"] == disk["fetches"] * b
    event = expert_tier_event(c, runs["store"].placement())
    assert event["fetches"] == host["fetches"] + disk["fetches"] and event["bytes_in"] == device["bytes_in"]
    assert sum(event["placement"].values()) == LAYERS * EXPERTS
    # The trainer's step event carries them (a run without a store adds nothing), and the dashboard reads them
    assert expert_step_fields(None) == {}
    step = make_event(
        "step",
        t=1.0,
        step=3,
        loss=1.0,
        lr=1e-3,
        grad_norm=1.0,
        tokens_per_s=1.0,
        tflops_per_gpu=1.0,
        mfu=0.1,
        consumed_samples=24,
        **expert_step_fields(runs["store"]),
    )
    state = RunState()
    reduce(state, step)
    assert state.experts is not None and state.experts.tier == event
    assert state.experts.hit_rate == device["hits"] / (device["hits"] + event["fetches"])


def test_budgets_that_cannot_work_are_refused(tmp_path: Path) -> None:
    model = MoeStack(HIDDEN, EXPERTS, 2)
    with pytest.raises(BadInput, match=r"must hold one MoE layer.s experts .*layer 0: 4 x 8,832 B"):
        ExpertStore(model.expert_layers(), device="cpu", device_budget_bytes=1000)
    with pytest.raises(BadInput, match="no disk directory"):
        ExpertStore(model.expert_layers(), device="cpu", device_budget_bytes=40_000, host_budget_bytes=0)


def test_evicted_expert_fails_loudly_and_disk_files_are_whole(tmp_path: Path) -> None:
    model = MoeStack(HIDDEN, EXPERTS, 2)
    layers = model.expert_layers()
    nbytes = ExpertStore([layers[0][:1]], device="cpu").slots[(0, 0)].nbytes
    (tmp_path / "layer000-expert0000.safetensors").write_bytes(b"an earlier launch's")  # stale: removed
    store = ExpertStore(layers, device="cpu", device_budget_bytes=EXPERTS * nbytes, host_budget_bytes=nbytes,
                        disk_dir=tmp_path)  # fmt: skip
    assert store.placement() == {"device": EXPERTS, "host": 1, "disk": EXPERTS - 1}
    assert layers[1][3].dense_h_to_4h.weight.numel() == 0  # a use without the hooks cannot read stale weights
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"layer001-expert{i:04d}.safetensors" for i in range(1, EXPERTS)
    ]  # no .tmp left behind: written under a temporary name, then renamed


def test_the_run_setting_builds_the_store() -> None:
    assert parse_overrides(["expert_device_budget_mb=1"]) == {"expert_device_budget_mb": 1}
    base = dict(
        seq_len=8, global_batch_size=2, micro_batch_size=1, train_samples=8, lr=3e-4, min_lr=0.0, warmup_samples=0,
        decay_samples=8, weight_decay=0.1, grad_clip=1.0, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
        eval_interval=10, eval_samples=0, save_interval=10, dtype="fp32", seed=0,
    )  # fmt: skip
    layers = MoeStack(HIDDEN, EXPERTS, 2).expert_layers()
    assert expert_store_for_run(layers, device="cpu", settings=TrainSettings(**base)) is None  # type: ignore[arg-type]
    settings = TrainSettings(**base, expert_device_budget_mb=1)  # type: ignore[arg-type]
    store = expert_store_for_run(layers, device="cpu", settings=settings)
    assert store is not None and store.device_budget == 2**20
    assert store.adamw == AdamWSettings(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    with pytest.raises(ValueError, match="expert_device_budget_mb must not be negative"):
        TrainSettings(**base, expert_device_budget_mb=-1)  # type: ignore[arg-type]
    # The host budget: a second tier after the device's, the rest of the experts on disk
    assert parse_overrides(["expert_host_budget_mb=2"]) == {"expert_host_budget_mb": 2}
    both = TrainSettings(**base, expert_device_budget_mb=1, expert_host_budget_mb=2)  # type: ignore[arg-type]
    store = expert_store_for_run(layers, device="cpu", settings=both)
    assert store is not None and (store.device_budget, store.host_budget) == (2**20, 2 * 2**20)
    with pytest.raises(ValueError, match=r"expert_host_budget_mb\(2\) needs expert_device_budget_mb > 0"):
        TrainSettings(**base, expert_host_budget_mb=2)  # type: ignore[arg-type]


def test_the_run_settings_reach_the_engine_with_a_disk_directory_per_rank(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """from_spec hands both budgets to build_engine in the spec's settings, which the engine reads in bytes, and a disk
    directory inside the run dir, one per rank."""
    from dataclasses import replace

    from appliance.hardware import load_hardware
    from appliance.parallel.step.build import expert_budget_bytes
    from appliance.planner import load_model_shape, make_plan, parse_layout
    from appliance.train import from_spec

    spec = make_plan(
        load_hardware("cpu-laptop-2core"), load_model_shape("bloom-moe-tiny-cpu"), layout=parse_layout("tp=1,pp=1,dp=1")
    ).spec()  # an MoE model: the plan refuses the store's budgets for a dense one (planner/layout_rules.py)
    spec = replace(spec, train=replace(spec.train, expert_device_budget_mb=3, expert_host_budget_mb=5))
    seen: dict = {}
    monkeypatch.setattr(from_spec, "build_engine", lambda *args, **kwargs: seen.update(kwargs, settings=args[3]))
    monkeypatch.setattr(from_spec.dist, "get_rank", lambda: 3)
    from_spec.engine_for(spec, None, None, run_dir=RunDir(tmp_path))  # type: ignore[arg-type]
    assert seen["settings"] is spec.train and expert_budget_bytes(seen["settings"]) == (3 * 2**20, 5 * 2**20)
    assert seen["expert_disk_dir"] == tmp_path / "expert_store" / "rank00003"


def test_experts_round_trip_through_read_and_load_in_every_tier(runs: dict, tmp_path: Path) -> None:
    """What a checkpoint does: read every expert of the trained store, load them into a store of another model
    placed differently (other experts on disk), read them back."""
    trained: ExpertStore = runs["store"]
    saved = {key: trained.read_expert(key) for key in trained.slots}
    assert all(t["dense_h_to_4h.weight.step"].item() == STEPS for t in saved.values())
    b = runs["expert_bytes"]
    fresh = ExpertStore(MoeStack(HIDDEN, EXPERTS, LAYERS, seed=5).expert_layers(), device="cpu",
                        device_budget_bytes=EXPERTS * b, host_budget_bytes=5 * b, disk_dir=tmp_path)  # fmt: skip
    assert set(fresh.placement().values()) != {0} and fresh.placement()["disk"] > 0
    for key, tensors in saved.items():
        fresh.load_expert(key, tensors)
    for key, tensors in saved.items():
        assert_all_equal(fresh.read_expert(key), tensors, f"expert {key}")
    with pytest.raises(BadInput, match=r"expert \(0, 0\) is missing dense_h_to_4h.weight.step"):
        fresh.load_expert((0, 0), {k: v for k, v in saved[(0, 0)].items() if not k.endswith("weight.step")})


def test_the_trainers_step_events_carry_the_counters(tmp_path: Path) -> None:
    from test_trainer_fp16 import ScriptedEngine, events, make_trainer, trained  # the trainer's scripted engine

    run_dir = RunDir(tmp_path / "run").make()
    dense = ScriptedEngine([trained(None), trained(None)])
    make_trainer(run_dir, dense, steps=2, dtype="fp32").fit()
    assert all("expert_tier" not in e for e in events(run_dir, "step"))

    run_dir = RunDir(tmp_path / "moe").make()
    moe = ScriptedEngine([trained(None), trained(None)])
    moe.expert_store = store = ExpertStore(MoeStack(HIDDEN, EXPERTS, 1).expert_layers(), device="cpu")  # type: ignore[attr-defined]
    store.fetch(store.slots[(0, 1)])  # one use: a hit
    make_trainer(run_dir, moe, steps=2, dtype="fp32").fit()
    steps = events(run_dir, "step")
    assert [e["expert_tier"]["hits"] for e in steps] == [1, 1]
    assert steps[-1]["expert_tier"] == expert_tier_event(store.counters(), store.placement())


def test_the_engine_refuses_the_store_where_it_is_not_wired() -> None:
    """fp16, ZeRO 2 and cp > 1 are refused in one message naming each key; fp32 and bf16 at ZeRO 0 and 1 pass at any
    pp."""
    from appliance.errors import BadInput
    from appliance.parallel.experts.store_engine import check_store_layout

    check_store_layout(is_moe=True, dtype="fp32", zero_stage=0, pp=1)
    check_store_layout(is_moe=True, dtype="fp32", zero_stage=0, pp=2)
    check_store_layout(is_moe=True, dtype="bf16", zero_stage=1, pp=2)
    with pytest.raises(BadInput, match=r"expert_host_budget_mb .* needs train.expert_device_budget_mb > 0"):
        check_store_layout(is_moe=True, dtype="fp32", zero_stage=0, pp=1, device_budget_bytes=0, host_budget_bytes=1)
    with pytest.raises(BadInput) as refused:
        check_store_layout(is_moe=False, dtype="fp16", zero_stage=0, pp=2)
    for key in ("expert_device_budget_mb", "moe_num_experts", "train.dtype is fp16"):
        assert key in str(refused.value), key
    check_store_layout(is_moe=True, dtype="fp32", zero_stage=1, pp=2)
    with pytest.raises(BadInput) as refused:
        check_store_layout(is_moe=True, dtype="fp32", zero_stage=2, pp=1, cp=2, tp=2)
    for key in ("expert_device_budget_mb", "zero_stage is 2", "cp is 2", "tp is 2"):
        assert key in str(refused.value), key


def test_a_clipped_step_with_the_engine_settings_matches_the_dense_optimizer() -> None:
    """What the engine asks of the store (parallel/experts/store_engine.py): the clip coefficient scales the gradients,
    biases get no weight decay and the kernel is torch's fused one, like the dense AdamW: the same bits as that AdamW on
    gradients scaled by the same coefficient, an evicted expert included."""
    torch.manual_seed(3)
    experts = [torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(2)]
    reference = [torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(2)]
    for mine, theirs in zip(experts, reference, strict=True):
        theirs.load_state_dict(mine.state_dict())
    settings = AdamWSettings(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, decay_vectors=False, fused=True)
    nbytes = 16 * sum(p.numel() for p in experts[0].parameters())
    store = ExpertStore([[experts[0]], [experts[1]]], device="cpu", device_budget_bytes=nbytes, adamw=settings)
    assert store.placement() == {"device": 1, "host": 1, "disk": 0}
    params = [p for e in reference for p in e.parameters()]
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
         {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
        lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused=True,
    )  # fmt: skip
    coefficient = 0.37
    for _ in range(2):
        grads = {id(p): torch.randn_like(p) for p in params}
        for key, expert in zip(((0, 0), (1, 0)), reference, strict=True):
            tensors = store.read_expert(key)
            for name, p in expert.named_parameters():
                tensors[f"{name}.grad"] = grads[id(p)].clone()
            store.load_expert(key, tensors)
        for p in params:
            p.grad = grads[id(p)] * coefficient
        optimizer.step()
        store.step(1e-2, grad_scale=coefficient)
    for key, expert in zip(((0, 0), (1, 0)), reference, strict=True):
        tensors = store.read_expert(key)
        for name, p in expert.named_parameters():
            assert torch.equal(tensors[name], p.detach()), (key, name)
            assert torch.equal(tensors[f"{name}.exp_avg_sq"], optimizer.state[p]["exp_avg_sq"]), (key, name)
