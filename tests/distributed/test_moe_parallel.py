"""Expert parallelism computes what one process computes: BLOOM-MoE's losses and gradients at ep = 2 and 4 equal the
single-process model's with the same weights, and a checkpoint written at ep = 2 (with pp = 2) loads at ep = 1 and
in one process.

Deterministic routing (docs/MOE.md): no token is dropped (each expert's capacity is its largest load, agreed over
the ep group) and no routing is random (no random token selection, no sampled second expert), so every token meets
the same experts whatever the layout and only the order of sums differs.

Two levels:
- the MoE layer alone in fp64 (``BloomMoE`` with DeepSpeed's all-to-all over our ep group against the same layer
  at ep = 1 on each rank's tokens): the same arithmetic, the all-to-all only moves rows, so a tight bound;
- the whole engine in fp32 (``build_engine`` at dp = ep = 2, 4 and at pp = 2, dp = ep = 2), one step's loss and
  gradients against the single-process model on the same micro-batches, within a few fp32 noise floors measured
  here (the reference's own fp32-vs-fp64 gap);
- experts with context parallelism (dp = cp = ep = 2, fp32 at ZeRO 0 and 1, bf16): the gradient DeepSpeed reduced
  against the single-process model with the load-balancing loss per CP half, and the checkpoint in one process.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from prepared_runs import cpu_only_env

from appliance.hardware.profile import load_hardware
from appliance.model.bloom import BloomForCausalLM
from appliance.model.config import BloomConfig
from appliance.model.moe import BloomMoE, canonical_moe_name
from appliance.model.ops import cross_entropy
from appliance.parallel.checkpoint.weight_shards import gather_full_state_dict
from appliance.parallel.experts.parallel import register_expert_groups
from appliance.parallel.step.deepspeed_comm import init_deepspeed_comm
from appliance.parallel.testing import build_test_engine, run_distributed
from appliance.parallel.topology import ParallelTopology

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parents[2]

# 4 blocks, MoE at blocks 1 and 3 (one per stage at pp = 2); 4 experts so ep = 1, 2, 4 all divide them; top-2 so
# the second expert's all-to-all path is exercised.
CONFIG = BloomConfig(
    vocab_size=256,
    hidden_size=32,
    n_layer=4,
    n_head=4,
    moe_num_experts=4,
    moe_top_k=2,
    moe_every=2,
    moe_drop_tokens=False,
    moe_random_routing=False,
    moe_aux_loss_coef=0.1,  # large enough that a lost or doubled load-balancing loss shows in the gradients
)
SEQ, MBS, SEED = 16, 2, 7
# fp32 bound: the layouts reorder the same sums as fp32 rounding does, at more places (the all-to-all's expert
# order, DP averaging, ZeRO), so a few times the reference's own rounding; measured 0.3-2 x, bound 10 x.
FP32_FACTOR = 10.0
FP64_BOUND = 1e-10  # fp64 rounding (1e-16) amplified through a few layers stays far below this


def batches(dp: int, seed: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One micro-batch per DP rank, (inputs, labels) as the engine takes them (labels are the next tokens):
    arithmetic progressions, something to learn."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(dp):
        start = torch.randint(0, 200, (MBS, 1), generator=g)
        stride = torch.randint(1, 7, (MBS, 1), generator=g)
        tokens = (start + stride * torch.arange(SEQ + 1)) % 200
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


@functools.cache
def drawn() -> BloomForCausalLM:
    """The single-process model as every layout draws it (drawing is the slow part: once per process)."""
    return BloomForCausalLM(CONFIG, seed=SEED)


@functools.cache
def reference(dp: int, dtype: torch.dtype) -> tuple[float, dict[str, torch.Tensor]]:
    """The single-process model on every DP rank's micro-batch: mean loss (language model's) and the gradient of
    the mean optimized loss (with the load-balancing loss), by layout-free name."""
    model = copy.deepcopy(drawn()).to(dtype)
    losses = []
    total = torch.zeros((), dtype=dtype)
    for ids, labels in batches(dp):
        lm_loss = cross_entropy(model(ids), labels)
        loss = lm_loss + CONFIG.moe_aux_loss_coef * model.moe_aux_loss()
        total = total + loss / dp
        losses.append(float(lm_loss.detach()))
    total.backward()
    grads = {canonical_moe_name(n): p.grad.detach().clone() for n, p in model.named_parameters()}
    return sum(losses) / dp, grads


def loaded_in_one_process(step_dir: Path) -> tuple[dict[str, torch.Tensor], BloomForCausalLM]:
    """The checkpoint read whole (every layout's files joined) and the single-process model it loads into: every
    saved name is the model's, and only the tied lm_head is not saved."""
    saved = gather_full_state_dict(step_dir)
    whole = BloomForCausalLM(CONFIG, seed=0)
    missing, unexpected = whole.load_state_dict(saved, strict=False)
    assert not unexpected and missing == ["lm_head.weight"]
    return saved, whole


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


# ---- the layer alone, fp64 -------------------------------------------------------------------------------------
def _layer_at(topology: ParallelTopology, ep: int) -> dict[str, Any]:
    """BloomMoE at ep over this rank's tokens: output, input gradient and this rank's experts' gradients (fp64)."""
    topology = ParallelTopology(tp=1, pp=1, dp=topology.dp, ep=ep, world_size=topology.world_size)
    topology.init_process_groups()
    init_deepspeed_comm(dist.get_backend())  # DeepSpeed's gate asks its own comm layer for the ep group's size
    register_expert_groups(topology)
    dense = copy.deepcopy(drawn()).double()  # the weights every layout draws
    layer = BloomMoE(CONFIG, ep_size=ep).double()
    layer.set_deepspeed_parallelism()
    ep_rank = topology.coordinate("ep", dist.get_rank())
    layer.expert_offset = ep_rank * layer.num_local_experts
    full = dense.transformer.h[1].mlp.state_dict(prefix="")
    layer.load_state_dict({k: v for k, v in full.items() if _held(k, layer)})
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    x = torch.randn(MBS, SEQ, CONFIG.hidden_size, generator=g, dtype=torch.float64, requires_grad=True)
    out, _ = layer(x)
    (out.square().sum() + layer.aux_loss).backward()
    grads = {canonical_moe_name(n, layer.expert_offset): p.grad for n, p in layer.named_parameters()}
    return {"x": x.detach(), "out": out.detach(), "x_grad": x.grad, "grads": grads}


def _held(name: str, layer: BloomMoE) -> bool:
    if ".experts." not in f".{name}":
        return True
    index = int(name.split("experts.")[1].split(".")[0])
    return layer.expert_offset <= index < layer.expert_offset + layer.num_local_experts


# ---- the engine, fp32 ------------------------------------------------------------------------------------------
def _engine(topology: ParallelTopology, ep: int, pp: int, hardware: Any = None) -> Any:
    os.environ.setdefault("LOCAL_RANK", "0")  # read by DeepSpeed
    dp = topology.world_size // pp
    topology = ParallelTopology(tp=1, pp=pp, dp=dp, ep=ep, world_size=topology.world_size)
    return build_test_engine(
        CONFIG,
        topology,
        micro_batch_size=MBS,
        global_batch_size=MBS * dp,
        grad_clip=0.0,
        lr=1e-2,  # the gradients are captured before the step; the step makes the saved weights differ from a draw
        seed=SEED,
        seq_len=SEQ,  # the all-to-all choice weighs exchanges of MBS x SEQ tokens
        hardware=hardware,  # None: the nodes are LOCAL_WORLD_SIZE ranks (parallel/experts/exchange.py node_size)
    )


def _second_step(engine: Any) -> dict[str, Any]:
    """Another step on other micro-batches: its loss and the weights after it (exact resume compares them)."""
    dp_rank = engine.topology.coordinate("dp", dist.get_rank())
    result = engine.train_batch([batches(engine.topology.dp, seed=4)[dp_rank]])
    return {"loss": result.loss, "weights": {n: p.detach().clone() for n, p in engine.named_parameters()}}


def _resumed(topology: ParallelTopology, step_dir: str) -> dict[str, Any]:
    """The layout that wrote the checkpoint, started afresh from it, then the second step."""
    engine = _engine(topology, 2, 2)
    engine.load_model(Path(step_dir))
    assert engine.load_optimizer(Path(step_dir))
    out = _second_step(engine)
    engine.close()
    return out


def _engine_step(topology: ParallelTopology, ep: int, pp: int, save_to: str, save: bool) -> dict[str, Any]:
    engine = _engine(topology, ep, pp)
    dp = engine.topology.dp
    captured: dict[str, torch.Tensor] = {}
    named = engine.named_parameters()

    def keep(name: str, param: torch.Tensor) -> Any:
        return param.register_hook(lambda g: captured.__setitem__(name, captured.get(name, 0) + g.detach().clone()))

    hooks = [keep(name, param) for name, param in named]
    dp_rank = engine.topology.coordinate("dp", dist.get_rank())
    result = engine.train_batch([batches(dp)[dp_rank]])
    for hook in hooks:  # this step's gradients only
        hook.remove()
    out = {"loss": result.loss, "aux": result.moe_aux_loss, "load": result.expert_load, "grads": captured}
    out["all_to_all"] = engine.all_to_all.kind if engine.all_to_all is not None else None
    step_dir = Path(save_to)
    if save:  # the first layout writes the checkpoint and reloads it at its own layout
        engine.save_model(step_dir, {"step": "1"})
        engine.save_optimizer(step_dir, engine.optimizer_shard(), {"step": "1"})
        dist.barrier()
        out["loaded_equal"] = _reload_equal(engine, step_dir)
        out["continued"] = _second_step(engine)
    else:  # the others load it at theirs (another ep, another pp): this rank's slices, layout-free names
        engine.load_model(step_dir)
        assert engine.load_optimizer(step_dir)
        out["loaded"] = {n: p.detach().clone() for n, p in engine.named_parameters()}
        out["loaded_adam"] = engine.optimizer_state()
    engine.close()
    return out


def _reload_equal(engine: Any, step_dir: Path) -> bool:
    before = {n: p.detach().clone() for n, p in engine.named_parameters()}
    with torch.no_grad():
        for _, p in engine.named_parameters():
            p.zero_()
    engine.load_model(step_dir)
    return all(torch.equal(before[n], p) for n, p in engine.named_parameters())


def _check_engine(results: list[dict[str, Any]], dp: int) -> None:
    _, grads32 = reference(dp, torch.float32)
    loss64, grads64 = reference(dp, torch.float64)
    floor = max(relative(grads32[n], grads64[n]) for n in grads64)
    # DP averages the loss and every gradient over the ranks' micro-batches; a parameter's hook saw this rank's
    # micro-batch only, so the sum over the ranks that hold it, over dp, is the averaged gradient.
    summed: dict[str, torch.Tensor] = {}
    for got in results:
        for name, grad in got["grads"].items():
            summed[name] = summed.get(name, 0) + grad.double() / dp
    assert set(summed) == set(grads64), sorted(set(summed) ^ set(grads64))
    for name, grad in summed.items():
        assert relative(grad, grads64[name]) < FP32_FACTOR * floor, name
    for got in results:
        assert abs(got["loss"] - loss64) / abs(loss64) < FP32_FACTOR * max(floor, 1e-7)
        assert got["aux"] is not None and got["aux"] > 0
        assert len(got["load"]) == len(CONFIG.moe_blocks)
        assert all(abs(sum(row) - 1.0) < 1e-9 for row in got["load"])
    assert all(got["load"] == results[0]["load"] for got in results), "expert load agreed by every rank"


# ---- one launch of 4 ranks for everything (spawning is the slow part) --------------------------------------------
LAYER_EPS = (2, 4)  # the MoE layer alone over dp = 4
# (pp, ep): the pipeline at dp = ep = 2 first (it writes the checkpoint the others load), then edp = 2 and 1 at pp = 1.
ENGINE_LAYOUTS = ((2, 2), (1, 2), (1, 4))


def _all_checks(topology: ParallelTopology, save_to: str) -> dict[str, Any]:
    out: dict[str, Any] = {f"layer_ep{ep}": _layer_at(topology, ep) for ep in LAYER_EPS}
    for pp, ep in ENGINE_LAYOUTS:
        out[f"engine_pp{pp}_ep{ep}"] = _engine_step(topology, ep, pp, save_to, save=(pp, ep) == ENGINE_LAYOUTS[0])
    out["resumed"] = _resumed(topology, save_to)
    out["tiered"] = _tiered(topology, str(Path(save_to).parent / "tiered"))
    for name in TIERED_MODES:
        out[f"tiered_{name}"] = _tiered_mode(topology, name, Path(save_to).parent / f"tiered-{name}-{dist.get_rank()}")
    out["hierarchical"] = _hierarchical_step(topology)  # last: it installs the hierarchical exchange
    out["epcp"] = _epcp_steps(topology, str(Path(save_to).parent / "epcp"))
    out["eptp"] = _eptp(topology, save_to)  # experts sharded over tp (its section at the end)
    return out


def _hierarchical_step(topology: ParallelTopology) -> dict[str, Any]:
    """The pp = 1, ep = 4 engine step again with the 4 ranks as 2 nodes of 2, as the run's hardware profile says
    (2 CPU nodes), while the launcher's LOCAL_WORLD_SIZE says one node of 4: the profile wins, the ep group spans
    both nodes, so the engine installs the hierarchical exchange."""
    from deepspeed.moe import sharded_moe

    from appliance.parallel.experts.all_to_all import MoeAllToAll

    before = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = "4"
    try:
        engine = _engine(topology, 4, 1, hardware=replace(load_hardware("cpu-laptop-2core"), nodes=2))
        installed, selected = sharded_moe._AllToAll, engine.all_to_all
        captured: dict[str, torch.Tensor] = {}
        hooks = [
            p.register_hook(lambda g, n=n: captured.__setitem__(n, captured.get(n, 0) + g.detach().clone()))
            for n, p in engine.named_parameters()
        ]
        result = engine.train_batch([batches(4)[engine.topology.coordinate("dp", dist.get_rank())]])
        for hook in hooks:
            hook.remove()
        engine.close()
    finally:
        if before is None:
            os.environ.pop("LOCAL_WORLD_SIZE")
        else:
            os.environ["LOCAL_WORLD_SIZE"] = before
    assert selected is not None
    counter = installed.counter if isinstance(installed, MoeAllToAll) else None
    return {
        "kind": selected.kind,
        "reason": selected.reason,
        "record": selected.record(),
        "installed_hierarchical": isinstance(installed, MoeAllToAll) and installed.kind == "hierarchical",
        "installed_is_engines": installed is selected.exchange,  # the engine holds what the layers call
        "exchanges": counter.calls if counter is not None else 0,
        "loss": result.loss,
        "grads": captured,
    }


# ---- the tiered expert store in the engine (parallel/experts/store_engine.py) ----------------------------------------
# pp = 1, dp = 4, ep = 2 (edp = 2): each rank holds 2 experts of each of the 2 MoE blocks. An expert is BLOOM's MLP,
# 2 x 32 x 128 weights + 128 + 32 biases = 8,352 fp32 parameters, x 4 copies (weights, gradients, Adam's two
# moments) = 133,632 B; the device budget holds one block's 2 experts, so every forward and backward evicts the
# other block's and fetches it back. The tiered run's host budget holds one expert, so of the 2 evicted one goes on
# to disk (host full -> disk) and every step reads and writes expert files; the resumed run's host is unlimited.
EXPERT_BYTES = 16 * (2 * CONFIG.hidden_size * 4 * CONFIG.hidden_size + 5 * CONFIG.hidden_size)
TIERED_BUDGET = 2 * EXPERT_BYTES
TIERED_HOST_BUDGET = EXPERT_BYTES
TIERED_STEPS = 3


# The other modes, each against its resident twin in this launch: pp = 2 (dp = ep = 2, edp = 1) with every block an
# MoE block, so each stage holds 2 blocks of 2 local experts and the budgets (2 experts on the device, 1 on the host)
# move them through all three tiers.
PP_CONFIG = dataclasses.replace(CONFIG, moe_every=1)
# bf16 (pp 1, dp 4, ep 2 as the first test, edp = 2: the store's fp32 gradients summed over 2 ranks; and at pp 2,
# where the first stage's experts get two bf16 gradients per micro-batch, the hidden states' backward and the carried
# MoE loss's): the store keeps DeepSpeed's bf16 optimizer's fp32 masters and gradients beside the bf16 weights and
# their bf16 gradients, 2 + 2 + 4 x 4 = 20 bytes per parameter, so the budgets are in bf16 experts' bytes. ZeRO 1
# (fp32) at pp 2: the pipeline's reduction and ZeRO's norm over both stages.
BF16_EXPERT_BYTES = EXPERT_BYTES // 16 * 20
TIERED_MODES: dict[str, dict[str, Any]] = {
    "pp2": {"pp": 2, "dp": 2, "config": PP_CONFIG},
    "bf16": {"dtype": "bf16", "expert_bytes": BF16_EXPERT_BYTES},
    "bf16_pp2": {"dtype": "bf16", "expert_bytes": BF16_EXPERT_BYTES, "pp": 2, "dp": 2, "config": PP_CONFIG},
    "zero1_pp2": {"zero_stage": 1, "pp": 2, "dp": 2, "config": PP_CONFIG},
}
MODE_STEPS = 2


def _tiered_engine(topology: ParallelTopology, budget: int, host_budget: int = 0, disk: Path | None = None,
                   *, pp: int = 1, dp: int = 4, config: BloomConfig = CONFIG, zero_stage: int = 0,
                   dtype: str = "fp32") -> Any:  # fmt: skip
    os.environ.setdefault("LOCAL_RANK", "0")
    topology = ParallelTopology(tp=1, pp=pp, dp=dp, ep=2, world_size=topology.world_size)
    return build_test_engine(config, topology, micro_batch_size=MBS, global_batch_size=MBS * 2 * dp,
                             zero_stage=zero_stage, dtype=dtype, grad_clip=1.0, lr=1e-2, weight_decay=0.1, seed=SEED,
                             expert_device_budget_bytes=budget, expert_host_budget_bytes=host_budget,
                             expert_disk_dir=disk)  # fmt: skip


def _tiered_mode(topology: ParallelTopology, name: str, disk: Path) -> dict[str, Any]:
    """One mode's resident and tiered engines, MODE_STEPS steps each."""
    mode = dict(TIERED_MODES[name])
    expert = mode.pop("expert_bytes", EXPERT_BYTES)
    runs = {}
    for kind, budgets in (("resident", (0, 0, None)), ("tiered", (2 * expert, expert, disk))):
        engine = _tiered_engine(topology, *budgets, **mode)
        runs[kind] = _tiered_steps(engine, 0, MODE_STEPS)
        runs[kind]["placement"] = engine.expert_store.placement() if engine.expert_store is not None else None
        engine.close()
    return runs


def _tiered_steps(engine: Any, first: int, last: int) -> dict[str, Any]:
    """Steps first..last-1 (2 micro-batches each: gradients accumulate while experts move), with clipping at 1.0
    and weight decay on (the store's AdamW must split decay as the dense optimizer does)."""
    from appliance.parallel.experts.store import expert_step_fields

    dp_rank = engine.topology.coordinate("dp", dist.get_rank())
    losses, norms, events = [], [], []
    for step in range(first, last):
        result = engine.train_batch([batches(engine.topology.dp, seed=10 * step + k)[dp_rank] for k in range(2)])
        losses.append(result.loss)
        norms.append(result.grad_norm)
        events.append(expert_step_fields(engine.expert_store))
    return {"losses": losses, "norms": norms, "events": events, "weights": engine.model_shard()}


def _tiered(topology: ParallelTopology, save_to: str) -> dict[str, Any]:
    """All-resident and tiered engines train the same steps; the tiered one saves after step 1, and a fresh
    tiered engine resumed from that checkpoint repeats the rest."""
    resident = _tiered_engine(topology, 0)
    want = _tiered_steps(resident, 0, TIERED_STEPS)
    resident.close()
    disk = Path(save_to).parent / f"tiered-disk-rank{dist.get_rank()}"
    tiered = _tiered_engine(topology, TIERED_BUDGET, TIERED_HOST_BUDGET, disk)
    got = _tiered_steps(tiered, 0, 1)
    step_dir = Path(save_to)
    if dist.get_rank() == 0:
        step_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    tiered.save_model(step_dir, {"step": "1"})
    tiered.save_optimizer(step_dir, tiered.optimizer_shard(), {"step": "1"})
    dist.barrier()
    rest = _tiered_steps(tiered, 1, TIERED_STEPS)
    placement = tiered.expert_store.placement()
    disk_files = sorted(p.name for p in disk.iterdir())
    tiered.close()
    resumed = _tiered_engine(topology, TIERED_BUDGET)
    resumed.load_model(step_dir)
    assert resumed.load_optimizer(step_dir)
    again = _tiered_steps(resumed, 1, TIERED_STEPS)
    resumed.close()
    return {"resident": want, "tiered_first": got, "tiered_rest": rest, "resumed": again, "placement": placement,
            "disk_files": disk_files}  # fmt: skip


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    step_dir = tmp_path_factory.mktemp("moe_checkpoint")
    return run_distributed(_all_checks, 4, str(step_dir), dp=4, timeout_s=300.0), step_dir


@pytest.mark.parametrize("ep", LAYER_EPS)
def test_moe_layer_fp64_at_ep_equals_one_process(launched: tuple[list[dict[str, Any]], Path], ep: int) -> None:
    results = [got[f"layer_ep{ep}"] for got in launched[0]]
    dense = copy.deepcopy(drawn()).double()
    reference = BloomMoE(CONFIG).double()
    reference.load_state_dict(dense.transformer.h[1].mlp.state_dict())
    grads: dict[str, torch.Tensor] = {}
    for rank, got in enumerate(results):
        reference.zero_grad()
        x = got["x"].clone().requires_grad_(True)
        out, _ = reference(x)
        (out.square().sum() + reference.aux_loss).backward()
        assert relative(got["out"], out) < FP64_BOUND, f"rank {rank} output"
        assert relative(got["x_grad"], x.grad) < FP64_BOUND, f"rank {rank} input gradient"
        for name, p in reference.named_parameters():
            grads[canonical_moe_name(name)] = grads.get(canonical_moe_name(name), 0) + p.grad
    # An expert's gradient sums the tokens of its ep group's ranks (the all-to-all brought them to it); the
    # reference's sums every rank's, so compare per ep group: each group must hold every expert exactly once.
    ep_groups = [list(range(g * ep, (g + 1) * ep)) for g in range(4 // ep)]
    for ranks in ep_groups:
        experts: dict[str, torch.Tensor] = {}
        for rank in ranks:
            for name, grad in results[rank]["grads"].items():
                if name.startswith("experts."):
                    assert name not in experts, f"{name} on two ep ranks"
                    experts[name] = grad
        assert len(experts) == CONFIG.moe_num_experts * 4, "every expert on one ep rank of the group"
        want = _expert_grads_of(ranks, results, reference)
        for name, grad in experts.items():
            assert relative(grad, want[name]) < FP64_BOUND, f"ep group {ranks}: {name}"


def _expert_grads_of(ranks: list[int], results: list[dict[str, Any]], reference: BloomMoE) -> dict[str, torch.Tensor]:
    reference.zero_grad()
    for rank in ranks:
        out, _ = reference(results[rank]["x"])
        (out.square().sum() + reference.aux_loss).backward()
    return {canonical_moe_name(n): p.grad.clone() for n, p in reference.named_parameters()}


@pytest.mark.parametrize(("pp", "ep"), ENGINE_LAYOUTS)
def test_engine_at_ep_equals_one_process(launched: tuple[list[dict[str, Any]], Path], pp: int, ep: int) -> None:
    _check_engine([got[f"engine_pp{pp}_ep{ep}"] for got in launched[0]], dp=4 // pp)


def test_engine_across_nodes_uses_the_hierarchical_exchange_bitwise(
    launched: tuple[list[dict[str, Any]], Path],
) -> None:
    """2 simulated nodes of 2 ranks, ep = 4: the engine installs the hierarchical exchange (the cost model prefers 2
    messages to 3) and its step equals the single-node (flat) step bit for bit: the exchange only moves data."""
    for rank, got in enumerate(launched[0]):
        hier, flat = got["hierarchical"], got["engine_pp1_ep4"]
        assert flat["all_to_all"] == "flat", f"rank {rank}: one node needs no hierarchy"
        assert hier["kind"] == "hierarchical" and hier["installed_hierarchical"], f"rank {rank}: {hier['reason']}"
        assert hier["installed_is_engines"], f"rank {rank}: engine.all_to_all is not the installed exchange"
        record = hier["record"]
        assert (record["ranks_per_node"], record["ranks_per_node_from"]) == (2, "hardware profile"), record
        assert "(LOCAL_WORLD_SIZE)" in record["warning"], record
        # 2 MoE blocks x (dispatch + combine) x (forward + backward)
        assert hier["exchanges"] == 2 * 2 * 2, f"rank {rank}"
        assert hier["loss"] == flat["loss"], f"rank {rank}"
        assert hier["grads"].keys() == flat["grads"].keys()
        for name, grad in hier["grads"].items():
            assert torch.equal(grad, flat["grads"][name]), f"rank {rank}: {name}"


def test_resume_at_pp2_ep2_is_exact(launched: tuple[list[dict[str, Any]], Path]) -> None:
    """Continuing after the save and restarting from it give the same next step, bit for bit."""
    for rank, got in enumerate(launched[0]):
        continued, resumed = got["engine_pp2_ep2"]["continued"], got["resumed"]
        assert resumed["loss"] == continued["loss"], f"rank {rank}"
        assert resumed["weights"].keys() == continued["weights"].keys()
        for name, value in resumed["weights"].items():
            assert torch.equal(value, continued["weights"][name]), f"rank {rank}: {name}"


def test_checkpoint_at_pp2_ep2_reloads_and_reshards_to_one_process(
    launched: tuple[list[dict[str, Any]], Path],
) -> None:
    results, step_dir = launched
    assert all(got["engine_pp2_ep2"]["loaded_equal"] for got in results)
    names = sorted(p.name for p in step_dir.iterdir() if not p.name.startswith("optim-"))
    assert names == [
        "experts-tp00-pp00-ep01.safetensors",
        "experts-tp00-pp01-ep01.safetensors",
        "model-tp00-pp00.safetensors",
        "model-tp00-pp01.safetensors",
    ], names
    # Resharded to one process: the whole model from the ep = 2, pp = 2 files, trained one step away from the draw.
    saved, whole = loaded_in_one_process(step_dir)
    assert set(whole.state_dict()) - {"lm_head.weight"} == set(saved)
    for name, want in whole.state_dict().items():
        key = "transformer.word_embeddings.weight" if name == "lm_head.weight" else name
        assert torch.equal(saved[key], want), name
    assert not torch.equal(saved["transformer.h.1.mlp.experts.3.dense_h_to_4h.weight"],
                           drawn().state_dict()["transformer.h.1.mlp.experts.3.dense_h_to_4h.weight"])  # fmt: skip
    # Resharded to pp = 1 at ep = 2 and ep = 4: every rank's parameters are the saved tensors, experts by global index.
    for layout in ("engine_pp1_ep2", "engine_pp1_ep4"):
        for rank, got in enumerate(results):
            assert got[layout]["loaded"].keys() <= saved.keys()
            for name, value in got[layout]["loaded"].items():
                assert torch.equal(value, saved[name]), f"{layout} rank {rank}: {name}"
    # Adam's state too: every parameter's moments and step, experts' from the ep rank that wrote them.
    from safetensors.torch import load_file

    from appliance.parallel.checkpoint.optimizer_state import optimizer_files

    adam: dict[str, torch.Tensor] = {}
    for _, _, path in optimizer_files(step_dir):
        adam |= load_file(str(path))
    assert {k.rsplit(".", 1)[0] for k in adam} == set(saved), "state for every parameter, written once"
    for layout in ("engine_pp1_ep2", "engine_pp1_ep4"):
        for rank, got in enumerate(results):
            assert got[layout]["loaded_adam"], f"{layout} rank {rank}: no optimizer state"
            for key, value in got[layout]["loaded_adam"].items():
                assert torch.equal(value, adam[key]), f"{layout} rank {rank}: {key}"
    experts = {n for got in results for n in got["engine_pp1_ep4"]["loaded"] if ".experts." in n}
    assert len(experts) == 2 * 4 * 4  # two MoE blocks, four experts, four tensors each: all of them, once


# ---- `run` end to end ------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_run_trains_bloom_moe_tiny_at_pp2_dp2_ep2(tmp_path: Path) -> None:
    """`run` on the sample corpus at tp=1, pp=2, dp=2, ep=2: plan, data, 2 training steps with the MoE figures in
    the step events, the final evaluation (lock-stepped over the ep groups) and the MoE export all finish."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "bloom_appliance.py"), "run", "--headless", "--model", "bloom-moe-tiny-cpu",
         "--layout", "tp=1,pp=2,dp=2,ep=2,mbs=2", "--max-steps", "2", "--run-dir", "runs/moe",
         "--set", "eval_task_limit=4", "--set", "eval_samples=2", "--set", "max_restarts=0"],
        cwd=tmp_path, capture_output=True, text=True, timeout=900, env=cpu_only_env(),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = tmp_path / "runs" / "moe"
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [e for e in events if e["kind"] == "step"]
    assert [e["step"] for e in steps] == [1, 2]
    for e in steps:
        assert isinstance(e["moe_aux_loss"], float) and e["moe_aux_loss"] > 0
        assert len(e["expert_load"]) == 2 and all(len(row) == 4 for row in e["expert_load"])
        assert all(abs(sum(row) - 1.0) < 1e-9 for row in e["expert_load"])
    step_dir = sorted((run_dir / "checkpoints").iterdir())[-1]
    assert (step_dir / "experts-tp00-pp01-ep01.safetensors").is_file()
    # The exchange the engine picked, with its reason: one host, so DeepSpeed's flat one.
    recorded = json.loads((run_dir / "ds_config.json").read_text())["moe_all_to_all"]
    assert recorded["kind"] == "flat" and "one node" in recorded["reason"], recorded
    config = json.loads((run_dir / "export" / "config.json").read_text())
    assert config["model_type"] == "bloom_moe" and config["moe"]["num_experts"] == 4


# ---- the tiered expert store ------------------------------------------------------------------------------------
def test_tiered_experts_train_like_resident_ones(launched: tuple[list[dict[str, Any]], Path]) -> None:
    """Device budget = one MoE block's experts, host budget = one expert, the rest on disk: the same losses, norms and
    weights as all resident."""
    for rank, got in enumerate(launched[0]):
        t = got["tiered"]
        want = t["resident"]
        losses = t["tiered_first"]["losses"] + t["tiered_rest"]["losses"]
        norms = t["tiered_first"]["norms"] + t["tiered_rest"]["norms"]
        assert t["placement"] == {"device": 2, "host": 1, "disk": 1}, f"rank {rank}"
        assert len(t["disk_files"]) == 1 and t["disk_files"][0].endswith(".safetensors"), t["disk_files"]
        assert losses == want["losses"], f"rank {rank}: {losses} != {want['losses']}"
        # The norm adds the store's squares summed in fp64 to the dense ones in fp32, where the resident run sums all
        # in fp32: one fp32 rounding of a sum of ~10^5 squares apart (measured 5e-8 relative). Clipping at 1.0 is not
        # reached (norms ~0.55), so the weights stay bitwise.
        assert all(abs(a - b) / b < 1e-5 for a, b in zip(norms, want["norms"], strict=True)), f"rank {rank}"
        assert t["tiered_rest"]["weights"].keys() == want["weights"].keys()
        for name, value in want["weights"].items():
            assert torch.equal(t["tiered_rest"]["weights"][name], value), f"rank {rank}: {name}"
        fields = [e["expert_tier"] for e in t["tiered_first"]["events"] + t["tiered_rest"]["events"]]
        assert fields[0]["fetches"] > 0 and fields[0]["evictions"] > 0 and fields[0]["hits"] > 0
        assert fields[-1]["fetches"] > fields[0]["fetches"]  # cumulative: every step moves experts
        # Host full -> disk: experts written to disk (host evictions) and read back from it (disk fetches) every step.
        disk_writes = [f["by_tier"]["host"]["evictions"] for f in fields]
        disk_reads = [f["by_tier"]["disk"]["fetches"] for f in fields]
        assert 0 < disk_writes[0] < disk_writes[-1] and 0 < disk_reads[0] < disk_reads[-1], (disk_writes, disk_reads)


def test_tiered_experts_resume_from_a_checkpoint(launched: tuple[list[dict[str, Any]], Path]) -> None:
    """Saved after step 1 with experts evicted, a fresh tiered engine repeats steps 2-3 bit for bit."""
    for rank, got in enumerate(launched[0]):
        rest, resumed = got["tiered"]["tiered_rest"], got["tiered"]["resumed"]
        assert resumed["losses"] == rest["losses"], f"rank {rank}"
        for name, value in rest["weights"].items():
            assert torch.equal(resumed["weights"][name], value), f"rank {rank}: {name}"


@pytest.mark.parametrize("mode", sorted(TIERED_MODES))
def test_tiered_experts_train_like_resident_ones_in_every_mode(
    launched: tuple[list[dict[str, Any]], Path], mode: str
) -> None:
    """Each mode the store runs in (TIERED_MODES): device, host and disk tiers in use, and the resident twin's
    losses and weights bit for bit (the norms within the fp64-vs-fp32 rounding of the first test)."""
    for rank, got in enumerate(launched[0]):
        resident, tiered = got[f"tiered_{mode}"]["resident"], got[f"tiered_{mode}"]["tiered"]
        assert tiered["placement"] == {"device": 2, "host": 1, "disk": 1}, f"rank {rank}"
        assert tiered["losses"] == resident["losses"], f"rank {rank}: {tiered['losses']} != {resident['losses']}"
        assert all(abs(a - b) / b < 1e-5 for a, b in zip(tiered["norms"], resident["norms"], strict=True)), rank
        assert tiered["weights"].keys() == resident["weights"].keys()
        for name, value in resident["weights"].items():
            assert torch.equal(tiered["weights"][name], value), f"{mode} rank {rank}: {name}"
        last = tiered["events"][-1]["expert_tier"]["by_tier"]
        assert last["disk"]["fetches"] > 0 and last["host"]["evictions"] > 0, f"rank {rank}: {last}"


# ---- experts with context parallelism (dp = 2, cp = 2, ep = 2) ---------------------------------------------------
# 4 ranks: dp rank d, cp rank c at global rank 2d + c; the ep groups are {0, 2} and {1, 3} (the two dp ranks at one cp
# coordinate), the edp x cp groups that reduce the experts' gradients {0, 1} and {2, 3}. Each CP rank routes its own
# half of every sequence, so its gate's load-balancing loss is its half's (GShard's local groups, docs/MOE.md): the
# reference computes it per half too, on the halves of the reference's own MoE inputs.
EPCP_DP, EPCP_CP, EPCP_EP, EPCP_MODE = 2, 2, 2, "ulysses"
# (dtype, ZeRO stage): fp32 at ZeRO 0 (the engine's reduction) and ZeRO 1 (ZeRO's expert partitions over edp x cp);
# bf16 (DeepSpeed's BF16_Optimizer hands its fp32 gradients to the engine's expert reduction).
EPCP_RUNS = (("fp32", 0), ("fp32", 1), ("bf16", 0))
BETA1 = 0.9


def _epcp_engine(topology: ParallelTopology, dtype: str, zero_stage: int) -> Any:
    os.environ.setdefault("LOCAL_RANK", "0")
    topology = ParallelTopology(tp=1, pp=1, dp=EPCP_DP, cp=EPCP_CP, ep=EPCP_EP, world_size=topology.world_size)
    return build_test_engine(CONFIG, topology, micro_batch_size=MBS, global_batch_size=MBS * EPCP_DP,
                             zero_stage=zero_stage, dtype=dtype, grad_clip=0.0, lr=1e-2, betas=(BETA1, 0.95),
                             seed=SEED, seq_len=SEQ, cp_mode=EPCP_MODE)  # fmt: skip


def _epcp_steps(topology: ParallelTopology, save_to: str) -> dict[str, Any]:
    """One step per ZeRO stage on the same micro-batches: loss, the MoE figures and Adam's first moment after it,
    which after one step is (1 - beta1) x the gradient DeepSpeed reduced (no clipping, no decay). The ZeRO 0 engine
    saves its checkpoint."""
    out: dict[str, Any] = {}
    for dtype, zero in EPCP_RUNS:
        engine = _epcp_engine(topology, dtype, zero)
        dp_rank = engine.topology.coordinate("dp", dist.get_rank())
        result = engine.train_batch([batches(EPCP_DP)[dp_rank]])
        state = engine.optimizer_state()  # collective over dp x cp at ZeRO 1
        moments = {k.rsplit(".", 1)[0]: v for k, v in state.items() if k.endswith(".exp_avg")}
        got = {"loss": result.loss, "aux": result.moe_aux_loss, "load": result.expert_load, "moments": moments}
        got["norm"] = result.grad_norm
        if (dtype, zero) == EPCP_RUNS[0]:
            step_dir = Path(save_to)
            if dist.get_rank() == 0:
                step_dir.mkdir(parents=True, exist_ok=True)
            dist.barrier()
            engine.save_model(step_dir, {"step": "1"})
            engine.save_optimizer(step_dir, engine.optimizer_shard(), {"step": "1"})
            got["weights"] = {n: p.detach().clone() for n, p in engine.named_parameters()}
        engine.close()
        out[f"{dtype}_zero{zero}"] = got
    return out


@functools.cache
def epcp_reference(dtype: torch.dtype) -> tuple[float, float, dict[str, torch.Tensor]]:
    """The single-process model on the dp micro-batches with the load-balancing loss per CP half: (language-model
    loss, unweighted load-balancing loss, both means over the dp x cp slices as the engine reports them; gradient of
    the mean optimized loss by layout-free name)."""
    from appliance.parallel.context.attention import split_sequence

    model = copy.deepcopy(drawn()).to(dtype)
    inputs: list[tuple[BloomMoE, torch.Tensor]] = []
    hooks = [
        m.register_forward_hook(lambda module, args, _: inputs.append((module, args[0])))
        for m in model.modules()
        if isinstance(m, BloomMoE)
    ]
    total, lm_sum, aux_sum = torch.zeros((), dtype=dtype), 0.0, 0.0
    for ids, labels in batches(EPCP_DP):
        inputs.clear()
        lm_loss = cross_entropy(model(ids), labels)
        # Each half through its layer again for its own aux loss (the expert outputs are not used): its gradient
        # reaches the gate and, through the half's MoE input, everything before it.
        halves = [split_sequence(x, EPCP_CP, c, EPCP_MODE) for _, x in inputs for c in range(EPCP_CP)]
        layers = [layer for layer, _ in inputs for _ in range(EPCP_CP)]
        aux = torch.stack([_aux_of(layer, half) for layer, half in zip(layers, halves, strict=True)]).sum() / EPCP_CP
        total = total + (lm_loss + CONFIG.moe_aux_loss_coef * aux) / EPCP_DP
        lm_sum, aux_sum = lm_sum + float(lm_loss.detach()), aux_sum + float(aux.detach())
    for hook in hooks:
        hook.remove()
    total.backward()
    grads = {canonical_moe_name(n): p.grad.detach().clone() for n, p in model.named_parameters()}
    return lm_sum / EPCP_DP, aux_sum / EPCP_DP, grads


def _aux_of(layer: BloomMoE, tokens: torch.Tensor) -> torch.Tensor:
    layer(tokens)
    assert layer.aux_loss is not None
    return layer.aux_loss


def _epcp_results(launched: tuple[list[dict[str, Any]], Path], dtype: str, zero: int) -> list[dict[str, Any]]:
    return [got["epcp"][f"{dtype}_zero{zero}"] for got in launched[0]]


@pytest.mark.parametrize("zero", [zero for dtype, zero in EPCP_RUNS if dtype == "fp32"])
def test_engine_at_dp2_cp2_ep2_equals_one_process(launched: tuple[list[dict[str, Any]], Path], zero: int) -> None:
    """The step's reported losses and the gradient DeepSpeed reduced, dense and expert, equal the single-process
    model's: the experts' over edp x cp, divided by dp x cp (an edp-only reduction would lose the other CP half's
    tokens, a missing cp division double them)."""
    results = _epcp_results(launched, "fp32", zero)
    lm64, aux64, grads64 = epcp_reference(torch.float64)
    # fp32 bound as FP32_FACTOR's: the reference's own fp32-vs-fp64 gap, times 10 for sums the layout reorders
    # (cp's attention exchange, the all-to-all, the reduction over dp x cp). The gap is that of the same model on
    # the same micro-batches with the whole-sequence aux loss (``reference``, shared with the ep tests: a reference
    # in fp32 costs seconds); with the aux loss per half it measured 3.8e-7 against 3.5e-7, and the worst gradient
    # here 4.2e-7, 1.2 x the floor, at ZeRO 0 and 1.
    _, grads32 = reference(EPCP_DP, torch.float32)
    floor = max(relative(grads32[n], reference(EPCP_DP, torch.float64)[1][n]) for n in grads32)
    norm64 = float(torch.stack([g.double().norm() for g in grads64.values()]).norm())
    seen: dict[str, torch.Tensor] = {}
    for rank, got in enumerate(results):
        assert abs(got["loss"] - lm64) / lm64 < FP32_FACTOR * max(floor, 1e-7), f"rank {rank}"
        assert abs(got["aux"] - aux64) / aux64 < FP32_FACTOR * max(floor, 1e-7), f"rank {rank}"
        assert got["load"] == results[0]["load"], "expert load agreed by every rank"
        # the global norm counts each expert once: its replicas over edp x cp hold the same reduced gradient
        assert abs(got["norm"] - norm64) / norm64 < FP32_FACTOR * floor, f"rank {rank}: norm {got['norm']}"
        for name, moment in got["moments"].items():
            grad = moment.double() / (1 - BETA1)  # Adam's first moment after one step from zero
            assert relative(grad, grads64[name]) < FP32_FACTOR * floor, f"rank {rank}: {name}"
            seen[name] = grad
    assert set(seen) == set(grads64), sorted(set(seen) ^ set(grads64))
    experts = [name for name in results[0]["moments"] if ".experts." in name]
    assert len(experts) == 2 * 2 * 4, "rank 0: two MoE blocks x two of the four experts x four tensors"


def test_engine_at_dp2_cp2_ep2_in_bf16_equals_one_process(launched: tuple[list[dict[str, Any]], Path]) -> None:
    """bf16 goes through DeepSpeed's BF16_Optimizer, whose fp32 gradients the engine reduces: the same average."""
    results = _epcp_results(launched, "bf16", 0)
    lm64, aux64, grads64 = epcp_reference(torch.float64)
    # bf16 bound: the single-process model's own bf16-vs-fp64 gap on the same micro-batches (measured 9.6e-3 for
    # the gradients), times 5 for the layout's reordered sums; the engine keeps fp32 gradients and masters, so it
    # measured below that gap (worst gradient 8.7e-3, loss 5e-6). A wrongly scaled or half-reduced expert gradient
    # is off by 0.5 or more.
    _, grads16 = reference(EPCP_DP, torch.bfloat16)
    floor = max(relative(grads16[n], reference(EPCP_DP, torch.float64)[1][n]) for n in grads16)
    for rank, got in enumerate(results):
        assert abs(got["loss"] - lm64) / lm64 < 5 * floor, f"rank {rank}"
        assert abs(got["aux"] - aux64) / aux64 < 5 * floor, f"rank {rank}"
        for name, moment in got["moments"].items():
            assert relative(moment.double() / (1 - BETA1), grads64[name]) < 5 * floor, f"rank {rank}: {name}"
    assert {name for got in results for name in got["moments"]} == set(grads64)


def test_checkpoint_at_cp2_ep2_reloads_at_one_process(launched: tuple[list[dict[str, Any]], Path]) -> None:
    """The ZeRO 0 engine's checkpoint holds every weight once and loads into the single-process model; Adam's state
    is written once per parameter though two CP ranks hold each expert."""
    from safetensors import safe_open

    from appliance.parallel.checkpoint.optimizer_state import optimizer_files

    step_dir = launched[1].parent / "epcp"
    saved, whole = loaded_in_one_process(step_dir)
    for rank, got in enumerate(_epcp_results(launched, *EPCP_RUNS[0])):
        for name, value in got["weights"].items():
            assert torch.equal(whole.state_dict()[name], value), f"rank {rank}: {name}"
    keys: list[str] = []
    for _, _, path in optimizer_files(step_dir):
        with safe_open(str(path), framework="pt") as f:
            keys += list(f.keys())
    assert len(keys) == len(set(keys)), sorted(k for k in keys if keys.count(k) > 1)[:4]
    assert {k.rsplit(".", 1)[0] for k in keys} == set(saved)


# ---- experts sharded over tensor parallelism (ep x tp) -----------------------------------------------------------
# tp = 2, dp = 2, ep = 2 on the 4 ranks: each expert's dense_h_to_4h is split by columns and dense_4h_to_h by rows
# over the tp pair, DeepSpeed drops the tokens duplicated over tp before the all-to-all and gathers them after.
# The layer alone in fp64 (same arithmetic, the tp all-reduce only splits one sum in two: FP64_BOUND), then one
# engine step in fp32 against the single-process model (_check_engine's measured floor), and its checkpoint.
EPTP = {"tp": 2, "dp": 2, "ep": 2}


def _eptp_layer(topology: ParallelTopology, ep: int) -> dict[str, Any]:
    """BloomMoE with tp-sharded experts at tp = 2, dp = 2 and ``ep`` on this dp rank's tokens (the same on both tp
    ranks): output, input gradient, and this rank's gradients (gate whole, experts' tp slices), fp64."""
    from deepspeed.utils import groups

    from appliance.parallel.step.grads import TopologyMPU
    from appliance.parallel.tensor.layers import tp_linear_factory
    from appliance.parallel.tensor.param_splits import shard_state_dict

    topology = ParallelTopology(pp=1, world_size=topology.world_size, **(EPTP | {"ep": ep}))
    topology.init_process_groups()
    init_deepspeed_comm(dist.get_backend())
    register_expert_groups(topology)
    groups.mpu = TopologyMPU(topology)  # deepspeed.initialize sets it in an engine; MOELayer reads tp from it
    try:
        rank = dist.get_rank()
        layer = BloomMoE(CONFIG, ep_size=ep, linear_factory=tp_linear_factory(topology)).double()
        layer.set_deepspeed_parallelism()
        layer.expert_offset = topology.coordinate("ep", rank) * layer.num_local_experts
        prefix = "transformer.h.1.mlp."
        full = {prefix + k: v for k, v in copy.deepcopy(drawn()).double().transformer.h[1].mlp.state_dict().items()}
        mine = shard_state_dict(full, topology.tp_rank(rank), 2)
        layer.load_state_dict({k[len(prefix) :]: v for k, v in mine.items() if _held(k[len(prefix) :], layer)})
        dp_rank = topology.coordinate("dp", rank)
        g = torch.Generator().manual_seed(100 + dp_rank)  # replicated over tp, as the block's LayerNorm output is
        x = torch.randn(MBS, SEQ, CONFIG.hidden_size, generator=g, dtype=torch.float64, requires_grad=True)
        out, _ = layer(x)
        (out.square().sum() + layer.aux_loss).backward()
        grads = {prefix + canonical_moe_name(n, layer.expert_offset): p.grad for n, p in layer.named_parameters()}
        coords = {"dp": dp_rank, "tp": topology.tp_rank(rank), "ep": topology.coordinate("ep", rank)}
        return {"x": x.detach(), "out": out.detach(), "x_grad": x.grad, "grads": grads, **coords}
    finally:
        groups.mpu = None
        groups.expert_tensor_parallel_world_size = 1


def _eptp_engine(topology: ParallelTopology, save_to: str) -> dict[str, Any]:
    """One engine step at tp = 2, dp = 2, ep = 2 (this rank's gradients and weights after it), then its checkpoint."""
    os.environ.setdefault("LOCAL_RANK", "0")
    topology = ParallelTopology(pp=1, world_size=topology.world_size, **EPTP)
    engine = build_test_engine(CONFIG, topology, micro_batch_size=MBS, global_batch_size=MBS * 2, grad_clip=0.0,
                               lr=1e-2, seed=SEED, seq_len=SEQ)  # fmt: skip
    captured: dict[str, torch.Tensor] = {}
    hooks = [
        p.register_hook(lambda g, n=n: captured.__setitem__(n, captured.get(n, 0) + g.detach().clone()))
        for n, p in engine.named_parameters()
    ]
    rank = dist.get_rank()
    dp_rank = topology.coordinate("dp", rank)
    result = engine.train_batch([batches(2)[dp_rank]])
    for hook in hooks:
        hook.remove()
    step_dir = Path(save_to)
    if rank == 0:
        step_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    engine.save_model(step_dir, {"step": "1"})
    engine.save_optimizer(step_dir, engine.optimizer_shard(), {"step": "1"})
    dist.barrier()
    weights = {n: p.detach().clone() for n, p in engine.named_parameters()}
    engine.close()
    return {"loss": result.loss, "aux": result.moe_aux_loss, "load": result.expert_load, "grads": captured,
            "weights": weights, "dp": dp_rank, "tp": topology.tp_rank(rank)}  # fmt: skip


def _eptp(topology: ParallelTopology, save_to: str) -> dict[str, Any]:
    layers = {f"layer_ep{ep}": _eptp_layer(topology, ep) for ep in (2, 1)}
    return layers | {"engine": _eptp_engine(topology, str(Path(save_to).parent / "eptp"))}


def _joined_over_tp(results: list[dict[str, Any]], key: str) -> list[dict[str, torch.Tensor]]:
    """Per dp rank, ``results[*][key]`` of its tp ranks joined into whole tensors (tensor.param_splits.gather_to_full:
    tp slices concatenated, replicated tensors checked equal)."""
    from appliance.parallel.tensor.param_splits import gather_to_full, role_of_parameter

    out = []
    for dp_rank in range(EPTP["dp"]):
        pair = sorted((r for r in results if r["dp"] == dp_rank), key=lambda r: r["tp"])
        joined = {}
        for name in pair[0][key]:
            role, is_bias = role_of_parameter(name)
            pieces = [r[key][name] for r in pair]
            if role == "replicated":  # the same on both tp ranks up to the order of sums: check, then keep one
                assert relative(pieces[1], pieces[0]) < FP64_BOUND or torch.equal(pieces[1], pieces[0]), name
                joined[name] = pieces[0]
            else:
                joined[name] = gather_to_full(pieces, role, is_bias=is_bias)
        out.append(joined)
    return out


@pytest.mark.parametrize("ep", [2, 1])
def test_moe_layer_with_tp_sharded_experts_equals_one_process(
    launched: tuple[list[dict[str, Any]], Path], ep: int
) -> None:
    results = [got["eptp"][f"layer_ep{ep}"] for got in launched[0]]
    reference = BloomMoE(CONFIG).double()
    reference.load_state_dict(copy.deepcopy(drawn()).double().transformer.h[1].mlp.state_dict())
    for rank, got in enumerate(results):
        reference.zero_grad()
        x = got["x"].clone().requires_grad_(True)
        out, _ = reference(x)
        (out.square().sum() + reference.aux_loss).backward()
        assert relative(got["out"], out) < FP64_BOUND, f"rank {rank} output"
        assert relative(got["x_grad"], x.grad) < FP64_BOUND, f"rank {rank} input gradient"
        gate = reference.deepspeed_moe.gate.wg.weight.grad
        assert relative(got["grads"]["transformer.h.1.mlp.gate.weight"], gate) < FP64_BOUND, f"rank {rank} gate"
    # Both tp ranks of a dp rank hold the same gate gradient; their expert slices join into whole experts, which
    # sum the tokens of the ep group: both dp ranks at ep = 2, each its own at ep = 1.
    joined = _joined_over_tp(results, "grads")
    ep_groups = [[0, 1]] if ep == 2 else [[0], [1]]  # dp ranks
    for dp_ranks in ep_groups:
        whole: dict[str, torch.Tensor] = {}
        for dp_rank in dp_ranks:
            whole |= {n: g for n, g in joined[dp_rank].items() if ".experts." in n}
        assert len(whole) == CONFIG.moe_num_experts * 4, "every expert once over the ep group"
        ranks = [rank for rank, r in enumerate(results) if r["tp"] == 0 and r["dp"] in dp_ranks]
        want = _expert_grads_of(ranks, results, reference)
        for name, grad in whole.items():
            assert relative(grad, want[name.removeprefix("transformer.h.1.mlp.")]) < FP64_BOUND, f"ep {ep}: {name}"


def test_engine_with_tp_sharded_experts_equals_one_process(launched: tuple[list[dict[str, Any]], Path]) -> None:
    """tp = 2, dp = 2, ep = 2: the step's loss and gradients are the single-process model's on both micro-batches."""
    results = [got["eptp"]["engine"] for got in launched[0]]
    per_dp = [next(r for r in results if r["dp"] == d and r["tp"] == 0) for d in range(EPTP["dp"])]
    joined = _joined_over_tp(results, "grads")
    _check_engine([r | {"grads": g} for r, g in zip(per_dp, joined, strict=True)], dp=EPTP["dp"])
    # The step: AdamW's first update is u(g) = -lr g / (|g| + eps) (bias-corrected moments, no decay), so each trained
    # weight is the drawn one plus u of the reference gradient, up to how far the gradient's rounding moves u. The
    # gradient is within FP32_FACTOR x floor x |g| of the reference (checked above), so an element's is within that
    # delta, and u moves by at most lr eps delta / (max(|g| - delta, 0) + eps)^2 (u' = lr eps / (|g| + eps)^2
    # grows towards g = 0; capped at 2 lr, a sign flip), plus the fp32 rounding of the weight before and after.
    _, grads32 = reference(EPTP["dp"], torch.float32)
    _, grads64 = reference(EPTP["dp"], torch.float64)
    floor = max(relative(grads32[n], grads64[n]) for n in grads64)
    before = drawn().state_dict()
    trained: dict[str, torch.Tensor] = {}
    for weights in _joined_over_tp(results, "weights"):
        trained |= weights
    lr, eps = 1e-2, 1e-8
    for name, grad in grads64.items():
        delta = FP32_FACTOR * floor * float(grad.norm())
        want = -lr * grad / (grad.abs() + eps)
        slope = eps / ((grad.abs() - delta).clamp(min=0.0) + eps) ** 2
        rounding = 2 * 2.0**-23 * (before[name].double().abs() + lr)
        allowed = lr * (delta * slope).clamp(max=2.0) + rounding
        got = trained[name].double() - before[name].double()
        assert bool(((got - want).abs() <= allowed).all()), name


def test_checkpoint_at_tp2_ep2_reloads_in_one_process(launched: tuple[list[dict[str, Any]], Path]) -> None:
    """The tp = 2, ep = 2 checkpoint (tp slices of every expert, ep rank 1's in files of their own) is the engine's
    weights after its step, whole, and loads into the single-process model."""
    results, step_dir = [got["eptp"]["engine"] for got in launched[0]], launched[1].parent / "eptp"
    names = sorted(p.name for p in step_dir.iterdir() if not p.name.startswith("optim-"))
    assert names == [
        "experts-tp00-pp00-ep01.safetensors",
        "experts-tp01-pp00-ep01.safetensors",
        "model-tp00-pp00.safetensors",
        "model-tp01-pp00.safetensors",
    ], names
    saved, _ = loaded_in_one_process(step_dir)
    trained: dict[str, torch.Tensor] = {}
    for joined in _joined_over_tp(results, "weights"):
        trained |= joined  # dp rank 1 adds the experts of ep rank 1; the dense weights agree (DP)
    assert set(trained) == set(saved)
    for name, value in trained.items():
        assert torch.equal(saved[name], value), name
    from safetensors import safe_open

    from appliance.parallel.checkpoint.optimizer_state import optimizer_files

    for tp_rank in range(EPTP["tp"]):  # every tp rank's Adam state covers every parameter's slice
        keys: set[str] = set()
        for t, _, path in optimizer_files(step_dir):
            if t == tp_rank:
                with safe_open(str(path), framework="pt") as f:
                    keys |= {k.rsplit(".", 1)[0] for k in f.keys()}  # noqa: SIM118 - not iterable
        assert keys == set(saved), sorted(keys ^ set(saved))
    drawn_state = drawn().state_dict()
    assert not torch.equal(saved["transformer.h.3.mlp.experts.3.dense_4h_to_h.weight"],
                           drawn_state["transformer.h.3.mlp.experts.3.dense_4h_to_h.weight"])  # fmt: skip
