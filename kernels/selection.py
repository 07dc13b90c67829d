"""Which implementation of each selectable op a run uses, chosen by measurement on the run's GPU at its shapes.

For each op of `kernels.backend_env.SELECTABLE`, at the shapes one rank of the run feeds it (`RankShapes`):
1. the candidates `op_backends.implementations(op, device)` offers (reference, compiled, triton, and the attention
   peers sdpa and flex) each run forward and backward once on the same inputs, and their outputs and input
   gradients are compared with the fp32 torch twin's (kernels.reference) on those inputs upcast: a candidate that
   raises or is off by more than CHECK_TOLERANCE is left out, its reason kept;
2. for flash attention's Triton kernel on a GPU, each tile configuration of `flash_attention.tile_candidates` is
   checked and timed likewise and the fastest is installed for that shape (`flash_attention.TUNED_TILES`), so
   Triton competes below with its best tiles;
3. the remaining candidates are timed, forward + backward, twice in opposite orders (each keeps its faster figure),
   and the fastest is chosen.
The timer is injectable (`Timer`); on CUDA it is `cuda_event_timer`: warm-up calls first (they also absorb
torch.compile's compilation and Triton's first builds), then back-to-back calls between one pair of CUDA events.

Each op's measurement (its choice, every candidate's time, the rejections, flash attention's tiles) is kept in a
`SelectionCache` (kernels.json, kernels/selection_cache.py) under the GPU, the software versions, the op and the
sizes that op is fed; `select` measures only the ops the cache has no entry for. Ops timed alone may rank otherwise
inside a compiled block, where inductor fuses the torch twins with their neighbours: kernels/selection_block.py
times the block with the chosen ops against the block with the twins and keeps the faster.

The result, a `Selection`, carries its key (device name, compute capability, torch, triton and project versions,
the rank's shapes), which the ranks compare. `Selection.apply()` installs it (the tiles, then
`registry.use(choices)`). Nothing here imports `appliance`; the engine's side is
appliance/parallel/step/kernel_choice.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from kernels import backend_env, op_backends, registry
from kernels.reference import alibi_slopes
from kernels.selection_cache import SelectionCache, entry_key

# Timer(op, backend, step) -> milliseconds per call of step() (one forward + backward).
Timer = Callable[[str, str, Callable[[], object]], float]
Implementations = Callable[[str, torch.device], Mapping[str, Callable[..., Any]]]

# A candidate is kept when max |candidate - fp32 twin| <= tolerance x max |fp32 twin|, for the output and each input
# gradient. Measured on CPU at 2 x 40 tokens (tests/kernels/test_selection.py shapes): in bf16 the bf16-rounded twin
# is off by up to 0.28% of the largest entry, SDPA 0.30%, the Triton kernels (interpreted) 0.73% (flash attention's
# gradient with documents: it rounds P and dS to bf16 before its products); fp32 candidates by at most 6.1e-7.
# Real shapes sum more terms (2048 keys, not 40): 2^-4 in bf16 (9x the worst measured) and 1e-4 in fp32 leave room
# for that, while a wrong mask or bias is off by O(1) of the largest entry (the tests check one is caught).
# fp16 keeps 3 more mantissa bits than bf16.
CHECK_TOLERANCE = {torch.bfloat16: 2.0**-4, torch.float16: 2.0**-7, torch.float32: 1e-4}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
REASON_CHARS = 300  # a rejection's reason, first line, as recorded


@dataclass(frozen=True)
class RankShapes:
    """What one rank of the run feeds the selectable ops, per micro-batch."""

    micro_batch_size: int
    seq_len: int  # tokens of each sequence this rank attends over
    hidden: int
    heads: int  # this rank's attention heads (heads / tp)
    head_dim: int
    ffn: int  # this rank's MLP width (ffn / tp)
    vocab: int  # this rank's vocabulary rows (padded vocabulary / tp)
    dtype: str  # "bfloat16", "float16" or "float32"
    documents: bool  # whether attention gets document ids (packed documents, reset_attention_mask)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass(frozen=True)
class SelectionKey:
    """Where a selection holds: equal keys, equal measurements to expect."""

    device: str  # the GPU's name as torch reports it ("cpu" for CPU)
    capability: str  # "9.0"; "" for CPU
    torch: str
    triton: str  # "" where Triton is not installed
    project: str
    shapes: RankShapes

    def differences(self, other: SelectionKey) -> list[str]:
        """'field: this vs other' for every field that differs (the shapes field by field)."""
        out = []
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if f.name == "shapes":
                out += [
                    f"shapes.{s.name}: {getattr(mine, s.name)!r} vs {getattr(theirs, s.name)!r}"
                    for s in fields(mine)
                    if getattr(mine, s.name) != getattr(theirs, s.name)
                ]
            elif mine != theirs:
                out.append(f"{f.name}: {mine!r} vs {theirs!r}")
        return out


def current_key(shapes: RankShapes, device: torch.device, project_version: str) -> SelectionKey:
    """This process's key for `shapes` on `device`."""
    device = torch.device(device)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = ""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        name, capability = torch.cuda.get_device_name(device), f"{major}.{minor}"
    else:
        name, capability = device.type, ""
    return SelectionKey(name, capability, torch.__version__, triton_version, project_version, shapes)


@dataclass
class Selection:
    """The measured choice: op -> backend, with every candidate's time, the rejected ones and why, and flash
    attention's tuned tiles (None where no Triton tile configurations were timed)."""

    key: SelectionKey
    choices: dict[str, str]
    times_ms: dict[str, dict[str, float]]
    rejected: dict[str, dict[str, str]] = field(default_factory=dict)
    flash_tiles: dict[str, Any] | None = None  # {"chosen": FlashConfig fields, "times_ms": {...}, "rejected": {...}}
    source: str = "measured"  # "cache" when every op (and the block check) was read from kernels.json
    cached: list[str] = field(default_factory=list)  # the ops (and "block") read from kernels.json
    # the block-level check (kernels/selection_block.py): {"choices", "chosen", "times_ms", "rejected", "per_op"}
    block: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Selection:
        """The Selection to_json wrote; a missing or unknown key is a ValueError naming it."""
        _known(data, cls, "selection")
        key = dict(data["key"])
        _known(key, SelectionKey, "selection.key")
        _known(key["shapes"], RankShapes, "selection.key.shapes")
        key["shapes"] = RankShapes(**key["shapes"])
        return cls(
            key=SelectionKey(**key),
            choices=dict(data["choices"]),
            times_ms={op: dict(t) for op, t in data["times_ms"].items()},
            rejected={op: dict(r) for op, r in data["rejected"].items()},
            flash_tiles=data["flash_tiles"],
            source=data["source"],
            cached=list(data["cached"]),
            block=data["block"],
        )

    def take(self, op: str, record: Mapping[str, Any]) -> None:
        """One op's measurement (`measure_op`'s record, or kernels.json's entry for it) into this selection."""
        self.times_ms[op] = dict(record["times_ms"])
        if record["choice"] is not None:
            self.choices[op] = record["choice"]
        if record["rejected"]:
            self.rejected[op] = dict(record["rejected"])
        if record["flash_tiles"] is not None:
            self.flash_tiles = record["flash_tiles"]

    def apply(self) -> None:
        """Run with this selection from now on: flash attention's tuned tiles for the key's shape, then the
        registry's choices (which apply to CUDA tensors under BLOOM_KERNELS=auto)."""
        self.install_tiles()
        registry.use(self.choices)

    def install_tiles(self) -> None:
        """Flash attention's tuned tiles for the key's shape (none where no tiles were timed)."""
        if self.flash_tiles is not None:
            from kernels import flash_attention

            config = flash_attention.FlashConfig(**self.flash_tiles["chosen"])
            flash_attention.TUNED_TILES[_tile_key(self.key)] = config

    def summary(self) -> str:
        """One line per op: the choice and its time, then the others' times and the rejected candidates; then the
        block-level check's combinations, where it ran."""
        lines = []
        for op, times in self.times_ms.items():
            choice = self.choices.get(op)
            others = ", ".join(f"{b} {ms:.3g}" for b, ms in sorted(times.items(), key=lambda kv: kv[1]) if b != choice)
            head = f"{op}: {choice} {times[choice]:.3g} ms" if choice in times else f"{op}: {choice or 'none ran'}"
            rejected = ", ".join(self.rejected.get(op, {}))
            lines.append(head + (f" (then {others})" if others else "") + (f"; rejected {rejected}" * bool(rejected)))
        if self.block is not None:
            ranked = sorted(self.block["times_ms"].items(), key=lambda kv: kv[1])
            lines.append("block: " + ", ".join(f"{label} {ms:.3g} ms" for label, ms in ranked))
        return "\n".join(lines)


def _known(data: Mapping[str, Any], cls: type, where: str) -> None:
    names = {f.name for f in fields(cls)}
    missing, unknown = sorted(names - set(data)), sorted(set(data) - names)
    if missing or unknown:
        raise ValueError(f"{where}: missing keys {missing}, unknown keys {unknown} (known: {sorted(names)})")


# ----- timers -------------------------------------------------------------------------------------------------------
def cuda_event_timer(warmup: int = 3, repeats: int = 10, trials: int = 5) -> Timer:
    """Milliseconds per call on the current CUDA stream: `warmup` calls, then `trials` times `repeats` calls back to
    back between one pair of CUDA events, so the figure is GPU time per call with no gap for the host between calls;
    the median trial, since a GPU shared with other work (or changing its clocks) slows a trial now and then (10 to
    25% apart between two timings of one kernel on an H200 with a single trial)."""

    def timer(op: str, backend: str, step: Callable[[], object]) -> float:
        for _ in range(warmup):
            step()
        torch.cuda.synchronize()
        per_call = []
        for _ in range(trials):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                step()
            end.record()
            end.synchronize()
            per_call.append(start.elapsed_time(end) / repeats)
        return sorted(per_call)[trials // 2]

    return timer


def default_timer(device: torch.device) -> Timer:
    """CUDA events on a GPU, the host's clock elsewhere."""
    return cuda_event_timer() if torch.device(device).type == "cuda" else wall_clock_timer()


def wall_clock_timer(warmup: int = 1, repeats: int = 3) -> Timer:
    """Milliseconds per call by the host's clock (CPU tensors)."""

    def timer(op: str, backend: str, step: Callable[[], object]) -> float:
        for _ in range(warmup):
            step()
        start = time.perf_counter()
        for _ in range(repeats):
            step()
        return (time.perf_counter() - start) * 1e3 / repeats

    return timer


# ----- one op's inputs, its fp32 twin, and the check ----------------------------------------------------------------
@dataclass
class OpCase:
    """One op at the run's shapes: the differentiable inputs (`leaves`, in the run's dtype), how a backend is
    called on them, the fp32 twin, and the output gradient (None for a scalar loss)."""

    leaves: tuple[torch.Tensor, ...]
    call: Callable[[Callable[..., Any], tuple[torch.Tensor, ...]], torch.Tensor]
    twin: Callable[..., Any]
    grad_out: torch.Tensor | None

    def run(
        self, fn: Callable[..., Any], leaves: tuple[torch.Tensor, ...] | None = None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Output and input gradients of one forward + backward (torch.autograd.grad: nothing accumulates)."""
        leaves = self.leaves if leaves is None else leaves
        out = self.call(fn, leaves)
        grad = None if self.grad_out is None else self.grad_out.to(out.dtype)
        return out, torch.autograd.grad(out, leaves, grad)

    def step(self, fn: Callable[..., Any]) -> Callable[[], object]:
        return lambda: self.run(fn)

    def expected(self) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The fp32 twin's output and gradients on these inputs upcast."""
        return self.run(self.twin, tuple(t.detach().float().requires_grad_() for t in self.leaves))

    def mismatch(self, fn: Callable[..., Any], expected: tuple[torch.Tensor, tuple[torch.Tensor, ...]]) -> str | None:
        """Why `fn`'s results are not the twin's (None: they are, within CHECK_TOLERANCE)."""
        out, grads = self.run(fn)
        tolerance = CHECK_TOLERANCE[self.leaves[0].dtype]
        for name, got, want in [("output", out, expected[0])] + [
            (f"gradient {i}", g, w) for i, (g, w) in enumerate(zip(grads, expected[1], strict=True))
        ]:
            if got.shape != want.shape:
                return f"{name} shape {tuple(got.shape)} != {tuple(want.shape)}"
            error = (got.detach().float() - want.detach()).abs().max()
            size = want.detach().abs().max()
            if not bool(torch.isfinite(got).all()) or bool(error > tolerance * size):
                return f"{name} off by {float(error):.3g} where the fp32 twin's largest entry is {float(size):.3g}"
        return None


def _randn(gen: torch.Generator, *shape: int, device: torch.device, dtype: torch.dtype, std: float = 1.0):
    return (torch.randn(*shape, generator=gen) * std).to(device, dtype).requires_grad_()


def document_ids(batch: int, seq: int, device: torch.device) -> torch.Tensor:
    """[batch, seq] ids of packed documents of uneven lengths: boundaries at 1/8, 3/8 and 1/2 of the sequence."""
    ids = torch.zeros(batch, seq, dtype=torch.long)
    for cut in (seq // 8, 3 * seq // 8, seq // 2):
        ids[:, cut:] += 1
    return ids.to(device)


def op_case(op: str, shapes: RankShapes, device: torch.device, seed: int = 0) -> OpCase:
    """`op`'s inputs as one rank of the run gives them (attention: q, k, v as strided views of the fused QKV
    projection, as appliance/model/bloom.py hands them over)."""
    from kernels import reference

    gen = torch.Generator().manual_seed(seed)
    b, s, h, dtype = shapes.micro_batch_size, shapes.seq_len, shapes.hidden, shapes.torch_dtype
    if op == "layer_norm":
        x, w, bias = (_randn(gen, *dims, device=device, dtype=dtype) for dims in ((b, s, h), (h,), (h,)))
        grad = torch.randn(b, s, h, generator=gen).to(device, dtype)
        return OpCase((x, w, bias), lambda fn, t: fn(t[0], t[1], t[2], 1e-5), reference.layer_norm, grad)
    if op == "bias_gelu":
        x, bias = (_randn(gen, *dims, device=device, dtype=dtype) for dims in ((b, s, shapes.ffn), (shapes.ffn,)))
        grad = torch.randn(b, s, shapes.ffn, generator=gen).to(device, dtype)
        return OpCase((x, bias), lambda fn, t: fn(t[0], t[1]), reference.bias_gelu, grad)
    if op == "flash_alibi_attention":
        qkv = _randn(gen, b, s, shapes.heads, 3, shapes.head_dim, device=device, dtype=dtype)
        slopes = alibi_slopes(shapes.heads, device)
        docs = document_ids(b, s, device) if shapes.documents else None

        def attend(fn: Callable[..., Any], t: tuple[torch.Tensor, ...]) -> torch.Tensor:
            q, k, v = (t[0][..., i, :].transpose(1, 2) for i in range(3))
            return fn(q, k, v, slopes, True, None, q_doc=docs, k_doc=docs)  # one tensor for both: the peers' case

        grad = torch.randn(b, shapes.heads, s, shapes.head_dim, generator=gen).to(device, dtype)
        return OpCase((qkv,), attend, reference.flash_alibi_attention, grad)
    if op == "vocab_cross_entropy":
        # hidden states and embedding rows at BLOOM's init scale, so the logits are O(1) as in training
        hidden = _randn(gen, b, s, h, device=device, dtype=dtype)
        weight = _randn(gen, shapes.vocab, h, device=device, dtype=dtype, std=h**-0.5)
        labels = torch.randint(0, shapes.vocab, (b, s), generator=gen).to(device)
        return OpCase((hidden, weight), lambda fn, t: fn(t[0], t[1], labels), reference.vocab_cross_entropy, None)
    raise ValueError(f"kernel selection: no inputs for op {op!r}")


def failure_reason(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip().splitlines()[0]
    return text[:REASON_CHARS]


def _free_cuda(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()  # what a rejected candidate left allocated, before the next one runs


# ----- flash attention's tiles ---------------------------------------------------------------------------------------
def _capability(key: SelectionKey) -> int | None:
    if not key.capability:
        return None
    major, minor = key.capability.split(".")
    return int(major) * 10 + int(minor)


def _tile_key(key: SelectionKey) -> tuple[int, torch.dtype, int, bool, int, int]:
    s = key.shapes
    capability = _capability(key)
    if capability is None:
        raise ValueError("flash attention tiles are tuned for GPUs only; this selection's key has no capability")
    return (s.head_dim, s.torch_dtype, capability, s.documents, s.seq_len, s.seq_len)


def tile_label(config: Any) -> str:
    return (
        f"fwd {config.fwd_m}x{config.fwd_n} dkdv {config.dkdv_m}x{config.dkdv_n} dq {config.dq_m}x{config.dq_n} "
        f"warps {config.warps} stages {config.stages}"
    )


def tune_flash_tiles(
    case: OpCase,
    triton_attention: Callable[..., Any],
    expected: tuple[torch.Tensor, tuple[torch.Tensor, ...]],
    key: SelectionKey,
    timer: Timer,
) -> dict[str, Any]:
    """Check and time the Triton flash kernel with each tile candidate at the key's shape; install the fastest in
    flash_attention.TUNED_TILES (and return {"chosen", "times_ms", "rejected"}, the record Selection keeps)."""
    from kernels import flash_attention

    s, tile_key = key.shapes, _tile_key(key)
    candidates = flash_attention.tile_candidates(s.head_dim, s.torch_dtype, tile_key[2], s.documents)
    times: dict[str, float] = {}
    rejected: dict[str, str] = {}
    by_label = {tile_label(c): c for c in candidates}
    for label, config in by_label.items():
        flash_attention.TUNED_TILES[tile_key] = config
        try:
            wrong = case.mismatch(triton_attention, expected)
            if wrong is not None:
                rejected[label] = wrong
                continue
            times[label] = timer("flash_alibi_attention", f"triton {label}", case.step(triton_attention))
        except Exception as error:  # a launch that fails to build or run leaves the other tiles to compete
            rejected[label] = failure_reason(error)
            _free_cuda(case.leaves[0].device)
    if not times:
        del flash_attention.TUNED_TILES[tile_key]  # launch_config's tiles, as without a selection
        return {"chosen": asdict(candidates[0]), "times_ms": {}, "rejected": rejected}
    best = min(times, key=lambda label: times[label])
    flash_attention.TUNED_TILES[tile_key] = by_label[best]
    return {"chosen": asdict(by_label[best]), "times_ms": times, "rejected": rejected}


# ----- the selection -------------------------------------------------------------------------------------------------
def select(
    shapes: RankShapes,
    device: torch.device,
    *,
    project_version: str,
    timer: Timer | None = None,
    implementations: Implementations | None = None,
    ops: tuple[str, ...] | None = None,
    cache: SelectionCache | None = None,
) -> Selection:
    """For each op (default: backend_env.SELECTABLE): `cache`'s entry for this GPU, software, op and shape where it
    has one, else every candidate measured at `shapes` on `device` (`measure_op`) and the record added to `cache`.
    Leaves measured tiles installed; call .apply() to route the ops (and install tiles read from the cache)."""
    device = torch.device(device)
    key = current_key(shapes, device, project_version)
    timer = timer or default_timer(device)
    offered = implementations or op_backends.implementations
    selection = Selection(key=key, choices={}, times_ms={}, rejected={})
    wanted = ops or backend_env.SELECTABLE
    for op in wanted:
        where = entry_key(asdict(key), op, asdict(shapes))
        record = None if cache is None else cache.get(where)
        if record is not None:
            selection.cached.append(op)
        else:
            record = measure_op(op, key, device, offered(op, device), timer)
            if cache is not None and record["choice"] is not None:  # a failure of every candidate is not kept
                cache.put(where, record)
        selection.take(op, record)
    if len(selection.cached) == len(wanted):
        selection.source = "cache"
    return selection


def measure_op(
    op: str, key: SelectionKey, device: torch.device, offered: Mapping[str, Callable[..., Any]], timer: Timer
) -> dict[str, Any]:
    """Check every candidate `offered` against the fp32 twin at the key's shapes, tune flash attention's tiles, then
    time those that passed: {"choice" (None when none passed), "times_ms", "rejected", "flash_tiles"}."""
    case = op_case(op, key.shapes, device)
    expected = case.expected()
    passing, rejected = {}, {}
    for backend, fn in offered.items():
        try:
            wrong = case.mismatch(fn, expected)
        except Exception as error:  # a candidate that cannot run here (a compile error, no backward on CPU)
            wrong = failure_reason(error)
            _free_cuda(device)
        if wrong is None:
            passing[backend] = fn
        else:
            rejected[backend] = wrong
    tiles = None
    if op == "flash_alibi_attention" and "triton" in passing and key.capability:
        tiles = tune_flash_tiles(case, passing["triton"], expected, key, timer)
    del expected
    times: dict[str, float] = {}
    # Two passes, the second in reverse order, each candidate keeping its faster figure: on an H200 one
    # candidate timed at different points of one selection read 0.66 and 1.09 ms (flash attention, the same
    # tiles), so a single timing, in one fixed order, can pick by when rather than by what.
    for backend in [*passing, *reversed(passing)]:
        if backend in rejected:
            continue
        try:
            ms = timer(op, backend, case.step(passing[backend]))
        except Exception as error:  # e.g. out of memory at repeated calls: the others still compete
            rejected[backend] = failure_reason(error)
            times.pop(backend, None)
            _free_cuda(device)
            continue
        times[backend] = min(ms, times.get(backend, ms))
    choice = min(times, key=lambda backend: times[backend]) if times else None
    return {"choice": choice, "times_ms": times, "rejected": rejected, "flash_tiles": tiles}
