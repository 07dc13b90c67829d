"""Each fused op against its torch twin and peers, at the shapes a training rank runs, with its share of the ceilings.

For every op, first the correctness check against the fp32 torch twin (kernels/reference.py); an op that fails it
is not timed. Then, per pass (forward, forward+backward): the device time per call (`ms`: on a GPU from back-to-back
calls between one pair of CUDA events, so launch gaps are left out; ceilings.Timer) and the host time per call
(`cpu_us`: what launching costs the CPU), the achieved bandwidth (memory-bound ops) or TFLOP/s (attention, the LM
head), its share of the ceiling measured in the same run (ceilings.py), and the speedup over each peer (peer time /
ours in device time, > 1: ours is faster; each peer's `<peer>_ms` and `<peer>_cpu_us` beside it). Attention is
measured at head dims 64, 80, 96 and 128 (every BLOOM preset's, bloom-560m to bloom-176b; `bench --quick` on a GPU
the model's own) with the rank's hidden width, against SDPA with an additive ALiBi+causal bias and FlexAttention
with an ALiBi score_mod (compiled on GPUs; eager on CPU, where compiling every shape would take minutes).
`calls_per_step` says how often one training step of the benchmarked model called the op (count_registry_calls): 0
means that path does not run this op on this device (CPU ranks run the torch twins).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from appliance.benchmark.ceilings import Thunk, Timer

HEAD_DIMS = (64, 80, 96, 128)
# bf16: output and gradients within 2% of the largest fp32 value (fp32 inputs are compared at the same bound)
TOLERANCE = 2e-2


@dataclass(frozen=True)
class RankShapes:
    """What one training rank's ops see: micro-batch x sequence tokens and the rank's widths (split by tp)."""

    batch: int
    seq: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    dtype: torch.dtype = torch.bfloat16

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


@dataclass
class Case:
    """One pass of one op: our thunk, the peers' thunks (a string: why that peer is absent), the work it does."""

    kernel: str
    passes: str  # "fwd" or "fwd+bwd"
    shape: str
    ours: Thunk
    peers: dict[str, Thunk | str]
    work: float  # bytes moved or floating-point operations per call
    unit: str  # "GB/s" or "TFLOP/s"
    notes: dict[str, Any] = field(default_factory=dict)


@contextmanager
def count_registry_calls() -> Iterator[Counter[str]]:
    """Calls to kernels.registry's ops while the block runs, whatever backend ran them (the registry's own counter,
    the one the fused-path tests read)."""
    from kernels import op_backends

    counts: Counter[str] = Counter()
    before = op_backends.call_counts()
    try:
        yield counts
    finally:
        for (op, backend), calls in op_backends.call_counts().items():
            if calls > before.get((op, backend), 0):
                counts[op] += calls - before.get((op, backend), 0)


def forward_only(fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor]) -> Thunk:
    """Inference forward: no graph is kept (and our LM-head loss skips its gradient work)."""

    def call() -> torch.Tensor:
        with torch.no_grad():
            return fn(*inputs)

    return call


def with_backward(fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor]) -> Thunk:
    """Forward then backward of fn(*inputs) with a fixed random output gradient (no .grad accumulation)."""
    out = fn(*inputs)
    grad_out = torch.randn_like(out) if out.dim() else torch.ones_like(out)
    wrt = [t for t in inputs if t.requires_grad]
    return lambda: torch.autograd.grad(fn(*inputs), wrt, grad_out)


def outputs_and_grads(fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out = fn(*inputs)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).to(out.device, out.dtype)
    grads = torch.autograd.grad(out, [t for t in inputs if t.requires_grad], grad_out)
    return [out, *grads]


def check(
    ours: Callable[..., torch.Tensor], reference: Callable[..., torch.Tensor], inputs: list[torch.Tensor]
) -> float:
    """Largest max|ours - fp32| / max|fp32| over the output and every input gradient; ours runs on the real
    inputs, the fp32 twin on fp32 copies of them."""
    upcast = [t.detach().float().requires_grad_(t.requires_grad) if t.is_floating_point() else t for t in inputs]
    errors = [
        ((a.float() - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
        for a, b in zip(outputs_and_grads(ours, inputs), outputs_and_grads(reference, upcast), strict=True)
    ]
    return max(errors)


class KernelCases:
    """Builds the cases of each op at `shapes` on `device`."""

    def __init__(self, device: torch.device, shapes: RankShapes, head_dims: Sequence[int] = HEAD_DIMS) -> None:
        from kernels import op_backends, reference, registry

        self.reference, self.registry, self.op_backends = reference, registry, op_backends
        self.device, self.cuda, self.shapes, self.head_dims = device, device.type == "cuda", shapes, head_dims
        self.gen = torch.Generator().manual_seed(0)

    def rand(self, *shape: int, scale: float = 1.0, grad: bool = True) -> torch.Tensor:
        t = (scale * torch.randn(*shape, generator=self.gen)).to(self.device, self.shapes.dtype)
        return t.requires_grad_(grad)

    def compiled(self, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor] | str:
        return torch.compile(fn) if self.cuda else "skipped on CPU: compiling each op takes minutes of C++ builds"

    def cases(self, kernel: str, shape: str, ours: Callable[..., torch.Tensor], peers: dict[str, Any],
              inputs: list[torch.Tensor], fwd_work: float, bwd_work: float, unit: str,
              no_backward: dict[str, str] | None = None) -> list[Case]:  # fmt: skip
        """A forward case and a forward+backward case; `peers` values are callables or why they are absent;
        `no_backward`: peers that have no backward here, and why."""
        made = []
        for passes, work in (("fwd", fwd_work), ("fwd+bwd", fwd_work + bwd_work)):
            wrap = forward_only if passes == "fwd" else with_backward
            absent = (no_backward or {}) if passes == "fwd+bwd" else {}
            wrapped = {
                name: absent.get(name) or (wrap(fn, inputs) if callable(fn) else fn) for name, fn in peers.items()
            }
            made.append(Case(kernel, passes, shape, wrap(ours, inputs), wrapped, work, unit))
        return made

    def layer_norm(self) -> tuple[float, list[Case]]:
        import torch.nn.functional as F

        n, tokens = self.shapes.hidden, self.shapes.tokens
        x, w, b = self.rand(tokens, n), self.rand(n, scale=0.1), self.rand(n, scale=0.1)
        error = check(self.registry.layer_norm, self.reference.layer_norm, [x, w, b])

        def torch_ln(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return F.layer_norm(x, (n,), w, b)

        apex = self.op_backends.nvidia_apex_layer_norm()
        peers: dict[str, Any] = {"torch_eager": torch_ln, "torch_compile": self.compiled(torch_ln)}
        peers["apex"] = (lambda x, w, b: apex(x, w, b, (n,), 1e-5)) if apex and self.cuda else "not installed"
        # forward reads x and writes y; backward reads x and dy and writes dx (weights are negligible)
        return error, self.cases("layer_norm", f"[{tokens}, {n}]", self.registry.layer_norm, peers, [x, w, b],
                                 2 * x.nbytes, 3 * x.nbytes, "GB/s")  # fmt: skip

    def bias_gelu(self) -> tuple[float, list[Case]]:
        import torch.nn.functional as F

        f, tokens = self.shapes.ffn, self.shapes.tokens  # the MLP's wide activation
        x, b = self.rand(tokens, f, scale=2.0), self.rand(f, scale=0.1)
        error = check(self.registry.bias_gelu, self.reference.bias_gelu, [x, b])

        def torch_bias_gelu(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return F.gelu(x + b, approximate="tanh")

        peers = {"torch_eager": torch_bias_gelu, "torch_compile": self.compiled(torch_bias_gelu)}
        return error, self.cases("bias_gelu", f"[{tokens}, {f}]", self.registry.bias_gelu, peers, [x, b],
                                 2 * x.nbytes, 3 * x.nbytes, "GB/s")  # fmt: skip

    def alibi_softmax(self) -> tuple[float, list[Case]]:
        b, h, s = self.shapes.batch, self.shapes.heads, self.shapes.seq
        slopes = self.reference.alibi_slopes(h, self.device)
        scores = self.rand(b, h, s, s, scale=3.0)
        mask = torch.ones(b, s, dtype=torch.long, device=self.device)
        mask[0, : s // 8] = 0  # some left padding

        def ours(x: torch.Tensor) -> torch.Tensor:
            return self.registry.alibi_softmax(x, slopes, mask, 0.125)

        def plain(x: torch.Tensor) -> torch.Tensor:  # the same math in torch ops (fp32 inside)
            return self.reference.alibi_softmax(x, slopes, mask, 0.125)

        error = check(ours, plain, [scores])
        peers = {"torch_eager": plain, "torch_compile": self.compiled(plain)}
        return error, self.cases("alibi_softmax", f"[{b}, {h}, {s}, {s}]", ours, peers, [scores],
                                 2 * scores.nbytes, 3 * scores.nbytes, "GB/s")  # fmt: skip

    def flash_attention(self, d: int) -> tuple[float, list[Case]]:
        b, s = self.shapes.batch, self.shapes.seq
        h = max(1, self.shapes.hidden // d)  # the rank's hidden width in heads of d
        slopes = self.reference.alibi_slopes(h, self.device)
        q, k, v = (self.rand(b, h, s, d) for _ in range(3))

        def ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return self.registry.flash_alibi_attention(q, k, v, slopes)

        def plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return self.reference.flash_alibi_attention(q, k, v, slopes)

        # the fp32 twin materializes the scores: check one sequence of an odd length (a ragged last block)
        error = check(ours, plain, [t[:1, :, : min(s, 1025)].detach().requires_grad_() for t in (q, k, v)])
        # causal FLOPs: 4 * b * h * s^2 * d / 2 forward, 2.5x that backward (FlashAttention-2's convention)
        fwd = 4 * b * h * s * s * d / 2
        no_backward = {} if self.cuda else {"flex_attention": "FlexAttention has no backward on CPU"}
        return error, self.cases(f"flash_attention_d{d}", f"[{b}, {h}, {s}, {d}]", ours, self.attention_peers(slopes),
                                 [q, k, v], fwd, 2.5 * fwd, "TFLOP/s", no_backward)  # fmt: skip

    def attention_peers(self, slopes: torch.Tensor) -> dict[str, Any]:
        """SDPA with an additive ALiBi+causal bias (eager, compiled), FlexAttention with an ALiBi score_mod,
        flash-attn's alibi_slopes when installed."""
        import torch.nn.functional as F
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        s = self.shapes.seq
        pos = torch.arange(s, device=self.device)
        rel = (pos[None, :] - pos[:, None]).float()  # j - i
        bias = (slopes.view(-1, 1, 1) * rel).masked_fill(rel > 0, float("-inf")).to(self.shapes.dtype)[None]

        def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)

        def alibi(score: torch.Tensor, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> torch.Tensor:
            return score + slopes[h] * (kv_idx - q_idx)

        causal = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, s, s, device=self.device)
        flex = torch.compile(flex_attention) if self.cuda else flex_attention

        def flex_alibi(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if not self.cuda:  # CPU FlexAttention refuses inputs that require grad even under no_grad (no backward)
                q, k, v = q.detach(), k.detach(), v.detach()
            return flex(q, k, v, score_mod=alibi, block_mask=causal)

        peers: dict[str, Any] = {
            "torch_eager_sdpa": sdpa,
            "torch_compile_sdpa": self.compiled(sdpa),
            "flex_attention": flex_alibi,
        }
        if not self.cuda:
            return peers | {"flash_attn": "GPU only"}
        try:
            from flash_attn import flash_attn_func  # [b, s, h, d]; causal ALiBi -slope * (i - j), as ours
        except ImportError:
            peers["flash_attn"] = "not installed"
        else:
            peers["flash_attn"] = lambda q, k, v: flash_attn_func(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, alibi_slopes=slopes
            ).transpose(1, 2)
        return peers

    def vocab_cross_entropy(self) -> tuple[float, list[Case]]:
        import torch.nn.functional as F

        n, hd, v = self.shapes.tokens, self.shapes.hidden, self.shapes.vocab
        hidden, weight = self.rand(n, hd), self.rand(v, hd, scale=0.02)
        labels = torch.randint(0, v, (n,), generator=self.gen).to(self.device)

        def ours(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return self.registry.vocab_cross_entropy(h, w, y)

        def plain(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # full fp32 logits
            return F.cross_entropy((h @ w.t()).float(), y)

        part = min(n, 512)
        error = check(ours, plain, [hidden[:part].detach().requires_grad_(), weight, labels[:part]])
        mm = 2 * n * hd * v  # the logits matmul; the two gradient matmuls cost as much again each
        peers = {"torch_eager": plain, "torch_compile": self.compiled(plain)}
        return error, self.cases("vocab_cross_entropy", f"[{n}, {hd}] x [{v}, {hd}]", ours, peers,
                                 [hidden, weight, labels], mm, 2 * mm, "TFLOP/s")  # fmt: skip

    def builders(self) -> dict[str, tuple[str, Callable[[], tuple[float, list[Case]]]]]:
        """Row name -> (the registry op it times, its builder)."""
        made: dict[str, tuple[str, Callable[[], tuple[float, list[Case]]]]] = {
            "layer_norm": ("layer_norm", self.layer_norm),
            "bias_gelu": ("bias_gelu", self.bias_gelu),
            "alibi_softmax": ("alibi_softmax", self.alibi_softmax),
        }
        for d in self.head_dims:
            made[f"flash_attention_d{d}"] = ("flash_alibi_attention", partial(self.flash_attention, d))
        made["vocab_cross_entropy"] = ("vocab_cross_entropy", self.vocab_cross_entropy)
        return made


def measure(case: Case, timer: Timer, ceiling: dict[str, Any]) -> dict[str, Any]:
    """ms: device time per call (the speedups compare these); cpu_us: host time per call (Timer.measure)."""
    timing = timer.measure(case.ours)
    ms = timing.ms
    achieved = case.work / ms / (1e6 if case.unit == "GB/s" else 1e9)  # bytes/ms -> GB/s, FLOP/ms -> TFLOP/s
    peak = ceiling["copy_gbps"] if case.unit == "GB/s" else ceiling["matmul_tflops"]
    result: dict[str, Any] = {"ms": ms, "cpu_us": timing.cpu_us, "unit": case.unit, "achieved": achieved,
                              "ceiling": peak, "pct_of_ceiling": 100 * achieved / peak}  # fmt: skip
    speedup = {}
    for name, peer in case.peers.items():
        if isinstance(peer, str):  # why this peer was not measured
            result[f"{name}_ms"] = peer
            continue
        peer_timing = timer.measure(peer)
        result[f"{name}_ms"], result[f"{name}_cpu_us"] = peer_timing.ms, peer_timing.cpu_us
        speedup[name] = peer_timing.ms / ms  # > 1: ours is faster
    result["speedup"] = speedup
    if "apex" in speedup:
        result["apex_faster"] = speedup["apex"] < 1.0  # the reason to call op_backends.use_apex_layer_norm(True)
    return result


def kernel_records(
    cases: KernelCases,
    timer: Timer,
    ceiling: dict[str, Any],
    *,
    only: Sequence[str] = (),
    calls: Counter[str] | None = None,
    progress: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """One record per op and pass (correctness first; an incorrect op is not timed, "correct" is False)."""
    records: list[dict[str, Any]] = []
    dtype = str(cases.shapes.dtype).removeprefix("torch.")
    for kernel, (op, build) in cases.builders().items():
        if only and not any(kernel.startswith(prefix) for prefix in only):
            continue
        error, made = build()
        for case in made:
            record: dict[str, Any] = {"kernel": kernel, "op": op, "pass": case.passes, "shape": case.shape,
                                      "dtype": dtype, "max_rel_error": error,
                                      "correct": error <= TOLERANCE}  # fmt: skip
            if calls is not None:
                record["calls_per_step"] = calls[op]
            records.append(record)
            if not record["correct"]:
                progress(f"{kernel:22s} {case.passes:8s} FAILED correctness: relative error {error:.2e} > {TOLERANCE}")
                continue
            record.update(measure(case, timer, ceiling))
            ratios = "  ".join(f"{name} x{value:.2f}" for name, value in record["speedup"].items())
            progress(f"{kernel:22s} {case.passes:8s} {record['ms']:9.3f} ms {record['cpu_us']:9.1f} us host"
                     f" {record['achieved']:8.2f} {case.unit:7s} {record['pct_of_ceiling']:5.1f}% of ceiling"
                     f"  {ratios}")  # fmt: skip
        if cases.cuda:
            torch.cuda.empty_cache()
    return records
