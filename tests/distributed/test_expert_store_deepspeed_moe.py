"""The tiered expert store under DeepSpeed's own MoE layer (deepspeed.moe.layer.MoE: learned top-1 TopKGate, its
capacity, the all-to-all over the expert-parallel group and the Experts container), on each of 2 gloo ranks: 3 MoE
layers of 4 BLOOM-MLP experts train 2 steps with the experts in the store under budgets that put them on device,
host and disk, and must give the same bits as the same layers all resident under torch's AdamW (foreach=False):
the output, the aux loss and the updated weights (which the gradients make). Unlike the unit test's fixed routing,
the gate here learns, so a wrong expert weight would also change which tokens go where in the second step. In the
same launch, the store's all-reduce averages expert gradients over the 2 ranks (expert-data parallel), evicted
experts included."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from appliance.parallel.testing import run_distributed

pytestmark = pytest.mark.distributed

HIDDEN, EXPERTS, LAYERS, STEPS = 8, 4, 3, 2
LR = 1e-2


def build() -> torch.nn.ModuleList:
    from deepspeed.moe.layer import MoE

    from appliance.parallel.experts.store_stand_in import BloomMlp

    torch.manual_seed(0)
    layers = torch.nn.ModuleList(
        MoE(HIDDEN, BloomMlp(HIDDEN), num_experts=EXPERTS, ep_size=1, k=1, use_rts=False, drop_tokens=False)
        for _ in range(LAYERS)
    )
    for layer in layers:
        layer.set_deepspeed_parallelism()
    return layers


def train(layers: torch.nn.ModuleList, step_experts: Any, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    g, outputs = torch.Generator().manual_seed(1), []
    for _ in range(STEPS):
        x, aux = torch.randn(2, 8, HIDDEN, generator=g), torch.zeros(())
        for layer in layers:
            out, layer_aux, _ = layer(x)
            x, aux = x + out, aux + layer_aux
        (x.pow(2).mean() + 0.01 * aux).backward()
        outputs += [x.detach().clone(), aux.detach().clone()]
        if step_experts is not None:
            step_experts()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return outputs


def tiered_against_resident(topology: Any) -> dict[str, Any]:
    from appliance.parallel.experts.store import ExpertStore
    from appliance.parallel.experts.store_hooks import attach_expert_store
    from appliance.parallel.step.deepspeed_comm import init_deepspeed_comm

    init_deepspeed_comm("gloo")  # DeepSpeed's comm over the rank's existing group
    reference = build()
    want = train(reference, None, torch.optim.AdamW(reference.parameters(), lr=LR, foreach=False))

    layers = build()
    containers = [layer.deepspeed_moe.experts for layer in layers]
    experts = {id(p) for c in containers for p in c.parameters()}
    nbytes = 16 * sum(p.numel() for p in containers[0].deepspeed_experts[0].parameters())  # 4 fp32 copies
    with tempfile.TemporaryDirectory() as disk:
        store = ExpertStore(
            [list(c.deepspeed_experts) for c in containers],
            device="cpu",
            device_budget_bytes=EXPERTS * nbytes,
            host_budget_bytes=2 * nbytes,
            disk_dir=Path(disk),
        )
        placement = store.placement()
        attach_expert_store(store, containers)
        dense = torch.optim.AdamW([p for p in layers.parameters() if id(p) not in experts], lr=LR, foreach=False)
        got = train(layers, lambda: store.step(lr=LR), dense)
        weights = {
            f"{li}.{ei}.{name}": tensor
            for (li, ei) in store.slots
            for name, tensor in store.read_expert((li, ei)).items()
            if not name.endswith((".grad", ".exp_avg", ".exp_avg_sq", ".step"))
        }
    want_weights = {
        f"{li}.{ei}.{name}": p.detach()
        for li, layer in enumerate(reference)
        for ei, expert in enumerate(layer.deepspeed_moe.experts.deepspeed_experts)
        for name, p in expert.named_parameters()
    }
    gates_equal = all(
        torch.equal(a.deepspeed_moe.gate.wg.weight, b.deepspeed_moe.gate.wg.weight)
        for a, b in zip(layers, reference, strict=True)
    )
    return {
        "placement": placement,
        "outputs_equal": [torch.equal(a, b) for a, b in zip(got, want, strict=True)],
        "weights_differ": sorted(k for k in want_weights if not torch.equal(weights[k], want_weights[k])),
        "gates_equal": gates_equal,
        "counters": store.counters(),
    }


def both(topology: Any) -> dict[str, Any]:
    return {"deepspeed": tiered_against_resident(topology), "reduce": reduced_grads(topology)}


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    """One launch of 2 gloo ranks for both tests (a launch costs more than either check)."""
    return run_distributed(both, 2, dp=2, timeout_s=300.0)


def test_tiered_deepspeed_moe_trains_like_the_resident_one(ranks: list[dict[str, Any]]) -> None:
    result = ranks[0]["deepspeed"]
    assert result["placement"] == {"device": EXPERTS, "host": 2, "disk": (LAYERS - 1) * EXPERTS - 2}
    assert all(result["outputs_equal"]), result["outputs_equal"]  # output and aux loss of each step
    assert result["weights_differ"] == [] and result["gates_equal"]
    counters = result["counters"]
    assert counters["disk"]["fetches"] > 0 and counters["host"]["fetches"] > 0 and counters["device"]["hits"] > 0


def reduced_grads(topology: Any) -> dict[str, Any]:
    """Each rank's expert gradients on its own data, plain and after the store's all-reduce over the 2 ranks (one
    layer's experts on the device, the other's in host memory)."""
    import torch.distributed as dist

    from appliance.parallel.experts.store import ExpertStore
    from appliance.parallel.experts.store_hooks import attach_expert_store
    from appliance.parallel.experts.store_stand_in import MoeStack

    x = torch.randn(2, 8, HIDDEN, generator=torch.Generator().manual_seed(10 + dist.get_rank()))
    plain = MoeStack(HIDDEN, EXPERTS, 2)
    plain(x).pow(2).mean().backward()
    model = MoeStack(HIDDEN, EXPERTS, 2)
    nbytes = 16 * sum(p.numel() for p in model.expert_layers()[0][0].parameters())
    store = ExpertStore(model.expert_layers(), device="cpu", device_budget_bytes=EXPERTS * nbytes)
    attach_expert_store(store, model.expert_containers())
    model(x).pow(2).mean().backward()
    store.all_reduce_grads()
    return {
        "own": {f"{li}.{ei}.{n}": p.grad for li, layer in enumerate(plain.expert_layers())
                for ei, e in enumerate(layer) for n, p in e.named_parameters()},
        "reduced": {f"{li}.{ei}.{n[:-5]}": t for (li, ei) in store.slots
                    for n, t in store.read_expert((li, ei)).items() if n.endswith(".grad")},
        "placement": store.placement(),
    }  # fmt: skip


def test_expert_gradients_are_averaged_over_the_expert_data_parallel_ranks(ranks: list[dict[str, Any]]) -> None:
    ranks = [rank["reduce"] for rank in ranks]
    assert ranks[0]["placement"] == {"device": EXPERTS, "host": EXPERTS, "disk": 0}
    for name, own in ranks[0]["own"].items():
        mean = (own + ranks[1]["own"][name]) / 2  # two addends: the same bits in any order
        assert not torch.equal(own, ranks[1]["own"][name]), name  # the ranks' data differ
        assert torch.equal(ranks[0]["reduced"][name], mean) and torch.equal(ranks[1]["reduced"][name], mean), name
