"""Communication volume per rank and step, counted as ring algorithms send it. The time model and the parallel
benchmark (which measures bytes on real gloo ranks) both read these counts.

Conventions: bytes SENT by one rank. A ring all-reduce of S bytes over n ranks sends 2 (n-1)/n S per rank; a
reduce-scatter or all-gather sends (n-1)/n S; a point-to-point transfer sends S.
- TP (Megatron 1D): per block and micro-batch, 2 all-reduces of the s b h activations forward (attention output,
  MLP output) and 2 backward (their input gradients); full recompute repeats the forward 2. The vocab-parallel
  embedding all-reduces its output forward (stage 0); the LM head all-reduces its input gradient (last stage).
  Sequence parallelism swaps each all-reduce for a reduce-scatter + all-gather: the same bytes.
- CP (context_parallel.py): per block and micro-batch, Ulysses all-to-alls q, k, v and the attention output,
  (c-1)/c of each b (s/c) h / t tensor, forward and backward; ring sends K, V c-1 times forward and K, V, dK, dV
  c-1 times backward; full recompute repeats the forward's exchange.
- PP (DeepSpeed pipeline engine): every TP rank sends the whole s b h activation forward and its gradient
  backward, once per micro-batch (s b h / t with sequence parallelism).
- DP (over dp x cp ranks: CP ranks hold the same weights): ZeRO-0 all-reduces the fp32 gradients; ZeRO-1
  (BLOOM's BF16_Optimizer) all-reduces them too, then all-gathers the updated weights; ZeRO-2 reduces the
  gradients of every micro-batch (DeepSpeed all-reduces them bucket by bucket) and all-gathers the weights.
- Tied embedding (pp > 1): first and last stage all-reduce the (fp32) embedding gradient between them.
"""

from __future__ import annotations

from appliance.planner import context_parallel
from appliance.planner.context_parallel import local_tokens
from appliance.planner.layout import Layout, pipeline_partition
from appliance.planner.memory import stage_parameters
from appliance.planner.model_shape import ModelShape


def allreduce_sent(size: float, n: int) -> float:
    return 2 * (n - 1) / n * size if n > 1 else 0.0


def gather_sent(size: float, n: int) -> float:
    """reduce-scatter or all-gather."""
    return (n - 1) / n * size if n > 1 else 0.0


def tp_allreduces_per_layer(recompute: str) -> int:
    return 6 if recompute == "full" else 4


def communication_bytes_per_rank(
    layout: Layout,
    model: ModelShape,
    *,
    seq_len: int | None = None,
    stage: int | None = None,
    act_bytes: int = 2,
    grad_bytes: int = 4,
    param_bytes: int = 2,
) -> dict[str, float]:
    """Bytes one rank sends per step: {"tp_allreduce", "cp_exchange", "pp_p2p", "dp_reduce", "tied_embedding",
    "total"}.
    `stage` picks the pipeline stage (None: the stage that sends the most). CPU fp32 runs pass act_bytes=4,
    param_bytes=4; gradients are reduced in fp32 (grad_bytes=4) under bf16 and fp32, in fp16 under fp16
    (grad_bytes=2: Device.grad_comm_bytes, as the time model counts them)."""
    stages = [stage] if stage is not None else list(range(layout.pp))
    counts = [_stage_bytes(layout, model, s, seq_len, act_bytes, grad_bytes, param_bytes) for s in stages]
    return max(counts, key=lambda c: c["total"])


def _stage_bytes(
    layout: Layout,
    model: ModelShape,
    stage: int,
    seq_len: int | None,
    act_bytes: int,
    grad_bytes: int,
    param_bytes: int,
) -> dict[str, float]:
    s = model.seq_len if seq_len is None else seq_len
    t, p, d = layout.tp, layout.pp, layout.dp_cp  # gradients reduce over dp x cp
    m = max(1, layout.micro_batches)
    activation = act_bytes * local_tokens(s, layout.cp) * layout.micro_batch_size * model.hidden
    partition = pipeline_partition(model.layers, p)
    blocks = partition.layers_per_stage[stage]

    allreduces = blocks * tp_allreduces_per_layer(layout.recompute)
    allreduces += (stage == 0) + (stage == p - 1)  # embedding output forward, LM-head input gradient backward
    tp_bytes = m * allreduces * allreduce_sent(activation, t)

    moved = context_parallel.exchange(model, layout, s, act_bytes)
    forwards = 2 if layout.recompute == "full" else 1
    cp_bytes = m * blocks * (forwards * moved.forward + moved.backward)

    sends = (stage < p - 1) + (stage > 0)  # activation forward, gradient backward
    p2p = activation / (t if layout.sequence_parallel else 1)
    pp_bytes = m * sends * p2p

    params = stage_parameters(model, layout, stage, partition)
    if layout.zero_stage == 0:
        dp_bytes = allreduce_sent(grad_bytes * params, d)
    elif layout.zero_stage == 1:
        dp_bytes = allreduce_sent(grad_bytes * params, d) + gather_sent(param_bytes * params, d)
    else:
        # Each rank keeps only its gradient partition, so every micro-batch's gradients are reduced as the backward
        # produces them; DeepSpeed does it with bucketed all-reduces (measured: bench/parallel_comm.py).
        dp_bytes = m * allreduce_sent(grad_bytes * params, d) + gather_sent(param_bytes * params, d)

    tied = 0.0
    if p > 1 and stage in (0, p - 1):
        # The two copies' gradients, in the optimizer's fp32 accumulation buffer (DeepSpeed's ReduceTiedGrads).
        tied = allreduce_sent(grad_bytes * model.padded_vocab(t) * model.hidden / t, 2)
    total = tp_bytes + cp_bytes + pp_bytes + dp_bytes + tied
    return {
        "tp_allreduce": tp_bytes,
        "cp_exchange": cp_bytes,
        "pp_p2p": pp_bytes,
        "dp_reduce": dp_bytes,
        "tied_embedding": tied,
        "total": total,
    }
