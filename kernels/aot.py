"""Ahead-of-time compiles of every Triton kernel for sm_80 (A100) and sm_90 (H100), on a machine without a GPU.

What a GPU would compile, and nothing else: the launchers themselves run on meta tensors laid out as training
lays them out (kernels.launch.recording), so the tile sizes, num_warps and num_stages are the ones they pick
for that shape and compute capability. Each recorded launch then goes through the steps Triton's
JITFunction.run takes on a first call (triton 3.7, runtime/jit.py): the kernel's binder specialises every
argument (a pointer or integer divisible by 16 gets `tt.divisibility = 16`, an integer equal to 1 becomes a
constant), `_pack_args` turns that into the ASTSource's signature, constexprs and attrs, and triton.compile
builds the cubin with the ptxas Triton ships. Resources come from that cubin (cuobjdump -res-usage, also
shipped): registers per thread, stack frame (where ptxas puts spilled registers; these kernels have no local
arrays, so a non-zero frame is a spill) and shared memory (Triton's dynamic allocation plus any static).

Needs a process where TRITON_INTERPRET is unset when `kernels.*` is imported (the interpreter replaces every
@triton.jit kernel); the tests run this in a subprocess for that reason.
"""

from __future__ import annotations

import math
import re
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kernels import bias_gelu, cross_entropy, flash_attention, layer_norm, softmax
from kernels.chunked_ce import auto_chunk_size
from kernels.launch import A100, H100, GpuTarget, Launch, recording

TARGETS = (A100, H100)

# Limits per compute capability, from the CUDA C++ Programming Guide, "Technical Specifications per Compute
# Capability": shared memory per thread block with the opt-in attribute 163 KiB on 8.0 (A100) and 227 KiB on
# 9.0 (H100); 255 registers per thread and 64 Ki 32-bit registers per SM on both.
SHARED_MEMORY_PER_BLOCK = {80: 163 * 1024, 90: 227 * 1024}
REGISTERS_PER_THREAD = 255
REGISTERS_PER_SM = 64 * 1024


@dataclass(frozen=True)
class TrainingShape:
    """What one tensor-parallel rank of a training run feeds the kernels."""

    model: str
    hidden: int
    head_dim: int
    heads: int  # attention heads of this rank
    ffn: int  # MLP width of this rank
    vocab: int  # vocabulary rows of this rank (padded vocabulary / tp)
    seq_len: int
    micro_batch: int = 1
    tp: int = 1


@dataclass(frozen=True)
class Recorded:
    """One launch a launcher made for `shape`, with what it is for: op, a size label ("d=128"), input dtype."""

    op: str
    size: str
    dtype: torch.dtype
    shape: TrainingShape
    launch: Launch


@dataclass
class Build:
    """One compiled kernel specialisation and its resources (one row of the table)."""

    kernel: str
    capability: int
    dtype: str
    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int
    signature: dict[str, str]
    divisible: list[str]  # arguments specialised as divisible by 16 (pointers: 16-byte aligned)
    not_divisible: list[str]  # pointer and integer arguments without that specialisation
    ones: list[str]  # integer arguments equal to 1, compiled in as constants
    registers: int = 0
    stack_bytes: int = 0  # per thread; non-zero means spills
    # Triton's dynamic shared memory plus the cubin's static: ptxas adds 1 KiB static to sm_90 kernels that use
    # shared memory although the PTX declares none; counted, to stay on the safe side of the limit.
    shared_bytes: int = 0
    sizes: list[str] = field(default_factory=list)
    models: list[str] = field(default_factory=list)

    @property
    def threads(self) -> int:
        return 32 * self.num_warps


def _meta(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def _grad_param(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return _meta(*shape, dtype=dtype).requires_grad_()


def _run_backward(out: torch.Tensor, grad: torch.Tensor | None = None) -> None:
    out.backward(torch.empty_like(out) if grad is None else grad)


def _layer_norm(s: TrainingShape, dtype: torch.dtype) -> None:
    # hidden states [b, s, hidden]; bf16 training keeps the LayerNorm weights in bf16 as well
    x = _grad_param(s.micro_batch, s.seq_len, s.hidden, dtype=dtype)
    w, b = _grad_param(s.hidden, dtype=dtype), _grad_param(s.hidden, dtype=dtype)
    _run_backward(layer_norm.layer_norm(x, w, b))


def _bias_gelu(s: TrainingShape, dtype: torch.dtype) -> None:
    x = _grad_param(s.micro_batch, s.seq_len, s.ffn, dtype=dtype)
    _run_backward(bias_gelu.bias_gelu(x, _grad_param(s.ffn, dtype=dtype)))


def _flash_attention(s: TrainingShape, dtype: torch.dtype) -> None:
    # As BloomSelfAttention (appliance/model/bloom.py) hands them over: views of the fused QKV projection
    # [b, s, heads, 3, d], transposed to [b, heads, s, d]; the output gradient arrives through the inverse
    # transpose of the context.
    qkv = _grad_param(s.micro_batch, s.seq_len, s.heads, 3, s.head_dim, dtype=dtype)
    q, k, v = (qkv[..., i, :].transpose(1, 2) for i in range(3))
    slopes = _meta(s.heads, dtype=torch.float32)
    out = flash_attention.flash_alibi_attention(q, k, v, slopes, causal=True)
    _run_backward(out, _meta(s.micro_batch, s.seq_len, s.heads, s.head_dim, dtype=dtype).transpose(1, 2))


def _flash_attention_packed(s: TrainingShape, dtype: torch.dtype) -> None:
    # Packed documents (document ids per token): the kernels' HAS_DOCS specialisation, whose every key block is
    # masked. Context-parallel ring attention launches the same kernels on chunks at global offsets.
    qkv = _grad_param(s.micro_batch, s.seq_len, s.heads, 3, s.head_dim, dtype=dtype)
    q, k, v = (qkv[..., i, :].transpose(1, 2) for i in range(3))
    slopes = _meta(s.heads, dtype=torch.float32)
    docs = _meta(s.micro_batch, s.seq_len, dtype=torch.int64)
    out = flash_attention.flash_alibi_attention(q, k, v, slopes, causal=True, q_doc=docs, k_doc=docs)
    _run_backward(out, _meta(s.micro_batch, s.seq_len, s.heads, s.head_dim, dtype=dtype).transpose(1, 2))


def _alibi_softmax(s: TrainingShape, dtype: torch.dtype, padded: bool) -> None:
    scores = _grad_param(s.micro_batch, s.heads, s.seq_len, s.seq_len, dtype=dtype)  # q @ k^T, contiguous
    mask = _meta(s.micro_batch, s.seq_len, dtype=torch.int64) if padded else None
    slopes = _meta(s.heads, dtype=torch.float32)
    _run_backward(softmax.alibi_softmax(scores, slopes, mask, 1.0 / math.sqrt(s.head_dim)))


def _cross_entropy(s: TrainingShape, dtype: torch.dtype) -> None:
    # The training loss's forward and backward on one rank: the last stage's final hidden states [tokens, hidden]
    # against its tied-embedding shard [V / tp, hidden]. One rank runs the public function (the driver is free of
    # host reads, so meta tensors go through it: one fused launch per chunk). Tensor parallelism needs a process
    # group for the driver's all-reduces, so its row launchers run as the driver calls them on the last TP rank:
    # statistics, then the gradient from the merged logsumexp, over the first chunk of the GPU rule.
    tokens = s.micro_batch * s.seq_len
    if s.tp == 1:
        hidden, weight = _grad_param(tokens, s.hidden, dtype=dtype), _grad_param(s.vocab, s.hidden, dtype=dtype)
        labels = _meta(tokens, dtype=torch.int64)
        _run_backward(cross_entropy.vocab_cross_entropy(hidden, weight, labels))
        return
    chunk = auto_chunk_size(tokens, s.hidden, s.vocab, gpu=True, logit_bytes=dtype.itemsize)
    hidden, weight = _meta(tokens, s.hidden, dtype=dtype), _meta(s.vocab, s.hidden, dtype=dtype)
    logits = hidden[:chunk] @ weight.t()
    labels = _meta(tokens, dtype=torch.int64)[:chunk]
    vocab_start = (s.tp - 1) * s.vocab
    row_max, sum_exp, _ = cross_entropy.ce_row_stats(logits, labels, vocab_start)
    lse = row_max + torch.log(sum_exp)
    inv_count = torch.empty((), dtype=torch.float32, device="meta")  # 1 / counted labels, on the device
    cross_entropy.ce_row_grad_(logits, labels, vocab_start, lse, inv_count, -100)


# op name -> (how it runs on a shape, the size label its configuration depends on)
OPS: dict[str, tuple[Callable[[TrainingShape, torch.dtype], None], Callable[[TrainingShape], str]]] = {
    "layer_norm": (_layer_norm, lambda s: f"N={s.hidden}"),
    "bias_gelu": (_bias_gelu, lambda s: f"N={s.ffn}"),
    "flash_attention": (_flash_attention, lambda s: f"d={s.head_dim}"),
    "flash_attention_packed": (_flash_attention_packed, lambda s: f"d={s.head_dim}"),
    "alibi_softmax": (lambda s, dt: _alibi_softmax(s, dt, padded=False), lambda s: f"K={s.seq_len}"),
    "alibi_softmax_padded": (lambda s, dt: _alibi_softmax(s, dt, padded=True), lambda s: f"K={s.seq_len}"),
    "cross_entropy": (_cross_entropy, lambda s: f"V={s.vocab}"),
}


def record(
    shapes: Sequence[TrainingShape], target: GpuTarget, dtypes: dict[str, tuple[torch.dtype, ...]]
) -> list[Recorded]:
    """Every launch the launchers make for forward and backward of each op on each shape, as on `target`.
    dtypes: op name -> input dtypes to run it with (ops not named: bf16)."""
    out = []
    for op, (run, size) in OPS.items():
        for shape in shapes:
            for dtype in dtypes.get(op, (torch.bfloat16,)):
                with recording(target) as launches:
                    run(shape, dtype)
                out += [Recorded(op, size(shape), dtype, shape, launch) for launch in launches]
    return out


def _specialise(launch: Launch, gpu: Any) -> tuple[Any, Any]:
    """(ASTSource, backend options) as JITFunction.run and _do_compile build them for this launch's arguments on
    `gpu` (triton 3.7; `_pack_args` is the JIT's own step from specialisation to signature, constexprs, attrs)."""
    from triton import knobs
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    kernel = launch.kernel
    if not isinstance(kernel, JITFunction):
        raise RuntimeError(
            f"kernels.aot: {getattr(kernel, '__name__', kernel)} was built for Triton's interpreter; import "
            "kernels.* in a process without TRITON_INTERPRET=1 to compile for a GPU"
        )
    backend = make_backend(gpu)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = dict(launch.options)
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return ASTSource(kernel, signature, constexprs, attrs), options


def _resources(cubin: bytes) -> tuple[int, int, int]:
    """(registers per thread, stack + local bytes per thread, static shared bytes) of the cubin's one kernel."""
    import triton

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        report = subprocess.run([str(cuobjdump), "-res-usage", f.name], capture_output=True, text=True, check=True)
    # e.g. "REG:182 STACK:0 SHARED:1024 LOCAL:0 CONSTANT[0]:648 ..."
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", report.stdout)
    if found is None:
        raise RuntimeError(f"kernels.aot: cannot read cuobjdump -res-usage output:\n{report.stdout}{report.stderr}")
    reg, stack, shared, local = (int(g) for g in found.groups())
    return reg, stack + local, shared


def compile_all(recorded: list[Recorded], target: GpuTarget) -> list[Build]:
    """Compile each distinct specialisation among `recorded` (all recorded for `target`) once."""
    import triton
    from triton.backends.compiler import GPUTarget

    gpu = GPUTarget("cuda", target.capability, 32)
    builds: dict[str, Build] = {}
    for rec in recorded:
        source, options = _specialise(rec.launch, gpu)
        key = f"{source.hash()}-{options.hash()}"
        if key not in builds:
            names = list(source.signature)
            divisible = [names[path[0]] for path, a in source.attrs.items() if ["tt.divisibility", 16] in a]
            constants = {names[path[0]]: v for path, v in source.constants.items()}
            runtime = [n for n, ty in source.signature.items() if ty.startswith(("*", "i")) and n not in divisible]
            compiled = triton.compile(source, target=gpu, options=options.__dict__)
            registers, stack, static_shared = _resources(compiled.asm["cubin"])
            builds[key] = Build(
                kernel=source.name,
                capability=target.capability,
                dtype=str(rec.dtype).removeprefix("torch."),
                constexprs={n: v for n, v in constants.items() if source.signature[n] == "constexpr" and n.isupper()},
                num_warps=options.num_warps,
                num_stages=options.num_stages,
                signature=dict(source.signature),
                divisible=divisible,
                not_divisible=runtime,
                ones=[n for n, v in constants.items() if not n.isupper() and type(v) is int and v == 1],
                registers=registers,
                stack_bytes=stack,
                shared_bytes=compiled.metadata.shared + static_shared,
            )
        build = builds[key]
        if rec.size not in build.sizes:
            build.sizes.append(rec.size)
        if rec.shape.model not in build.models:
            build.models.append(rec.shape.model)
    return list(builds.values())


def representatives(recorded: list[Recorded]) -> list[Recorded]:
    """The first launch of each kernel in recording order (from the largest model when the shapes come largest
    first): one compile per kernel for a quick check."""
    seen: set[str] = set()
    out = []
    for rec in recorded:
        name = rec.launch.kernel.__name__
        if name not in seen:
            seen.add(name)
            out.append(rec)
    return out


def problems(build: Build) -> list[str]:
    """What would stop this build from launching, or slow it down, on its target; empty when none."""
    found = []
    if build.stack_bytes:
        found.append(f"{build.stack_bytes} bytes of stack per thread (register spills)")
    if build.registers > REGISTERS_PER_THREAD:
        found.append(f"{build.registers} registers per thread > {REGISTERS_PER_THREAD}")
    if build.registers * build.threads > REGISTERS_PER_SM:
        found.append(f"{build.registers} registers x {build.threads} threads > {REGISTERS_PER_SM} per SM")
    limit = SHARED_MEMORY_PER_BLOCK[build.capability]
    if build.shared_bytes > limit:
        found.append(f"{build.shared_bytes} bytes of shared memory > {limit} per block")
    return found
