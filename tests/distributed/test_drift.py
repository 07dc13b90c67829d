"""The replica drift check: silent on identical copies, loud on one ulp of drift on one rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from appliance.parallel.tensor.drift import ReplicaDriftError, check_replicated_parameters, replicated_across_tp
from appliance.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from appliance.parallel.testing import run_distributed
from appliance.parallel.topology import ParallelTopology

pytestmark = pytest.mark.distributed

PERTURBED_RANK = 3  # global rank; tp rank 1 of the TP group [2, 3], dp rank 1 of the DP group [1, 3]


class TinyLayer(nn.Module):
    def __init__(self, topology: ParallelTopology) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(8)
        self.dense_h_to_4h = ColumnParallelLinear(8, 32, group=topology.tp_group)
        self.dense_4h_to_h = RowParallelLinear(32, 8, group=topology.tp_group)


def _drift_scenarios(topology: ParallelTopology) -> dict[str, object]:
    torch.manual_seed(0)
    layer = TinyLayer(topology)
    report: dict[str, object] = {}
    replicated = replicated_across_tp(layer.named_parameters())
    report["checked"] = check_replicated_parameters(replicated, topology.tp_group)
    if dist.get_rank() == PERTURBED_RANK:
        with torch.no_grad():
            weight = layer.input_layernorm.weight
            weight[5] = torch.nextafter(weight[5], torch.tensor(float("inf")))  # one ulp
    for label, group, params in (
        ("tp", topology.tp_group, replicated_across_tp(layer.named_parameters())),
        ("dp", topology.dp_group, list(layer.named_parameters())),  # DP replicas hold every parameter alike
    ):
        try:
            check_replicated_parameters(params, group)
            report[label] = "passed"
        except ReplicaDriftError as error:
            report[label] = str(error)
    # A tolerance wider than one ulp accepts the same copies.
    report["tolerant"] = check_replicated_parameters(replicated, topology.tp_group, atol=1e-6)
    report["odd one out"] = _odd_one_out()
    return report


def test_drift_check_passes_on_identical_copies_and_names_one_ulp_of_drift() -> None:
    results = run_distributed(_drift_scenarios, 4, tp=2, dp=2, timeout_s=120)
    replicated = ["input_layernorm.weight", "input_layernorm.bias", "dense_4h_to_h.bias"]
    for rank, report in enumerate(results):
        assert report["checked"] == replicated
        assert report["tolerant"] == replicated
        if rank in (0, 1):  # TP group [0, 1] never saw the perturbation
            assert report["tp"] == "passed"
        else:
            message = report["tp"]
            assert "1 replicated parameter(s) drifted" in message
            assert "input_layernorm.weight: ranks [1] (global [3]) differ from rank 0" in message
            assert "in 1 of 8 elements" in message
        if rank in (0, 2):  # DP group [0, 2]
            assert report["dp"] == "passed"
        else:
            assert "input_layernorm.weight: ranks [1] (global [3]) differ from rank 0" in report["dp"]
        assert "ln_f.weight: ranks [2] (global [2]) differ from rank 0, max |diff| 5.000e-01" in report["odd one out"]


def _odd_one_out() -> str:
    """With three or more copies, the one that disagrees with the majority is named, not the reference."""
    tp4 = ParallelTopology(tp=4, pp=1, dp=1, world_size=4)
    tp4.init_process_groups()
    weight = nn.Parameter(torch.ones(4))
    if dist.get_rank() == 2:
        with torch.no_grad():
            weight[0] = 1.5
    try:
        check_replicated_parameters([("ln_f.weight", weight)], tp4.tp_group)
    except ReplicaDriftError as error:
        return str(error)
    return "passed"
