"""2D tensor parallelism's layout key, mesh and 2D sharding, without processes.

The layout key ``tp2d=Q`` puts Q x Q ranks in tp's place and refuses what it cannot run with, naming every factor;
the topology lays the mesh out row-major inside the tp axis; parallel/tensor/param_splits.py's 2D cut and rejoin are
inverse, give each mesh column whole attention heads, and reshard a state dict 2D -> one process -> 1D -> one process
exactly.
"""

from __future__ import annotations

import pytest
import torch

from appliance.errors import BadInput
from appliance.model.bloom import BloomForCausalLM
from appliance.model.config import BloomConfig
from appliance.parallel.tensor.param_splits import (
    gather_state_dicts,
    gather_state_dicts_2d,
    gather_to_full_2d,
    shard_from_full_2d,
    shard_state_dict,
    shard_state_dict_2d,
)
from appliance.parallel.tensor2d.bloom2d import Bloom2D
from appliance.parallel.tensor2d.layers2d import Mesh2D
from appliance.parallel.topology import ParallelTopology
from appliance.planner.layout import parse_layout


def test_tp2d_key_takes_tp_place_in_the_world_size() -> None:
    layout = parse_layout("tp2d=2,pp=2,dp=3,mbs=2")
    assert (layout.tp, layout.tp2d, layout.tp_ranks, layout.world_size) == (1, 2, 4, 24)
    assert layout.factors == "tp2d(2)^2 * pp(2) * dp(3)"
    assert parse_layout(layout.describe()) == layout
    assert layout.to_dict()["tp2d"] == 2 and "tp2d" not in parse_layout("tp=2,pp=1,dp=1").to_dict()
    with pytest.raises(BadInput, match=r"tp2d\(2\)\^2 \* pp\(2\) \* dp\(3\) = 24 != world size 8"):
        layout.validate(8, heads=4, layers=2)
    with pytest.raises(BadInput, match=r"heads\(6\) is not divisible by tp2d\(4\)"):
        parse_layout("tp2d=4,pp=1,dp=1,mbs=4").validate(16, heads=6, layers=2)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tp=2,tp2d=2,pp=1,dp=1,mbs=2", r"tp2d\(2\) and tp\(2\) are both set"),
        ("tp2d=2,pp=1,dp=1,mbs=2,sp=1", r"tp2d\(2\) with sp: the mesh already splits every activation"),
        ("tp2d=2,pp=1,dp=1,mbs=2,cp=2", r"tp2d\(2\) with cp\(2\)"),
        ("tp2d=2,pp=1,dp=1,mbs=3", r"mbs\(3\) is not divisible by tp2d\(2\)"),
        ("tp2d=0,pp=1,dp=1", r"tp2d must be a positive integer"),
    ],
)
def test_tp2d_refuses_what_it_cannot_run_with(text: str, message: str) -> None:
    with pytest.raises(BadInput, match=message):
        parse_layout(text)


def test_topology_mesh_is_row_major_inside_tp() -> None:
    topology = ParallelTopology(tp=4, pp=2, dp=1, world_size=8, tp2d=2)
    assert topology.groups("tp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert topology.groups("tp_row") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topology.groups("tp_col") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topology.groups("mp") == [list(range(8))]  # the global norm spans the mesh and the stages
    assert [(topology.coordinate("mesh_row", r), topology.coordinate("mesh_col", r)) for r in range(4)] == [
        (0, 0), (0, 1), (1, 0), (1, 1)
    ]  # fmt: skip
    assert topology.factors == "tp2d(2)^2 * pp(2) * dp(1)"
    with pytest.raises(BadInput, match=r"tp2d\(2\) makes a 2 x 2 mesh of tp ranks, so tp must be 4, got tp\(2\)"):
        ParallelTopology(tp=2, pp=1, dp=1, world_size=2, tp2d=2)
    one_d = ParallelTopology(tp=2, pp=1, dp=2, world_size=4)  # a 1 x tp mesh: rows are tp, columns single ranks
    assert one_d.groups("tp_row") == one_d.groups("tp") and one_d.groups("tp_col") == [[0], [1], [2], [3]]
    assert "mesh_row" not in one_d.coordinates(0)


@pytest.mark.parametrize("q", [2, 3])
def test_2d_cut_and_rejoin_are_inverse(q: int) -> None:
    g = torch.Generator().manual_seed(0)
    for shape in [(6 * q, 4 * q), (5 * q,)]:
        full = torch.randn(shape, generator=g)
        blocks = [[shard_from_full_2d(full, r, c, q) for c in range(q)] for r in range(q)]
        assert torch.equal(gather_to_full_2d(blocks), full)
        if len(shape) == 2:  # block (r, c) = [dim0 slice c, dim1 slice r]
            assert torch.equal(blocks[1][0], full[: shape[0] // q, shape[1] // q : 2 * shape[1] // q])
    vector = torch.arange(4.0)
    drifted = [[shard_from_full_2d(vector, r, c, 2) for c in range(2)] for r in range(2)]
    drifted[1][0] = drifted[1][0] + 1
    with pytest.raises(ValueError, match="vector slice 0 differs between mesh row 0 and mesh row 1"):
        gather_to_full_2d(drifted)
    with pytest.raises(ValueError, match=r"tp2d\(2\) cannot cut a parameter of shape \(3, 4\)"):
        shard_from_full_2d(torch.zeros(3, 4), 0, 0, 2)


def test_qkv_column_slices_hold_whole_heads() -> None:
    """Mesh column c's QKV rows are heads [c * n/q, (c+1) * n/q), each with its q, k and v (BLOOM's per-head
    [q, k, v] interleave), as the 1D cut gives tp rank c."""
    heads, head_dim, hidden, q = 4, 3, 12, 2
    row_ids = torch.arange(3 * hidden, dtype=torch.float64)[:, None].expand(3 * hidden, hidden)
    for c in range(q):
        rows = shard_from_full_2d(row_ids, 0, c, q)[:, 0].view(heads // q, 3, head_dim)
        first_head = c * heads // q
        assert int(rows[0, 0, 0]) == first_head * 3 * head_dim  # q of the column's first head
        assert int(rows[-1, 2, -1]) == (first_head + heads // q) * 3 * head_dim - 1  # v of its last head


def test_state_dict_reshards_2d_to_one_process_to_1d() -> None:
    full = BloomForCausalLM(BloomConfig(vocab_size=32, hidden_size=16, n_layer=1, n_head=4), seed=3).state_dict()
    full.pop("lm_head.weight")  # tied to the word embeddings
    mesh = [shard_state_dict_2d(full, r, c, 2) for r in range(2) for c in range(2)]
    rejoined = gather_state_dicts_2d(mesh, 2)
    assert rejoined.keys() == full.keys() and all(torch.equal(rejoined[k], full[k]) for k in full)
    one_d = gather_state_dicts([shard_state_dict(rejoined, rank, 2) for rank in range(2)])
    assert all(torch.equal(one_d[k], full[k]) for k in full)


def test_q1_is_the_plain_model_exactly() -> None:
    """On a 1 x 1 mesh the 2D model is built from the plain model's own layers: loss and every gradient equal
    BloomForCausalLM's bit for bit (a 2D layer left in at q = 1 would reorder sums and miss by rounding)."""
    config = BloomConfig(vocab_size=32, hidden_size=16, n_layer=1, n_head=4)
    reference = BloomForCausalLM(config, seed=5)
    model = Bloom2D(config, Mesh2D.single())
    model.load_full(reference.state_dict())
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    want, got = reference.loss(ids, ids), model.loss(ids, ids)
    want.backward()
    got.backward()
    assert torch.equal(got, want)
    grads = dict(model.named_parameters())
    for name, param in reference.named_parameters():
        assert param.grad is not None and torch.equal(grads[name].grad, param.grad), name
