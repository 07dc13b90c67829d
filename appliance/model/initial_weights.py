"""BLOOM's initial weights as a pure function of (seed, parameter name, element index): any slice draws on its own.

A weight element is never taken from a generator's running state. Its value is computed from its position in the
*full* tensor, so a rank holding rows [a, b) or columns [c, d) of a matrix computes exactly those numbers, on its own
device, and they equal the same elements of the single-process model. Every layout (any tp, pp, dp) therefore
starts from the same weights, and no rank ever holds more than its own shard.

The arithmetic, for a matrix viewed as [R, C] and its element (r, c):

1. key = mix(mix(seed + G) + blake2b_64(name)) mod 2^64, once per parameter, in Python integers.
   G = 0x9E3779B97F4A7C15 (2^64 / golden ratio, splitmix64's increment); mix is splitmix64's finaliser
   (Steele, Lea, Flood 2014): z ^= z >>> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >>> 27; z *= 0x94D049BB133111EB;
   z ^= z >>> 31, every product modulo 2^64.
2. Elements (r, 2j) and (r, 2j + 1) share pair q = r * ceil(C / 2) + j, and z = mix(key + (q + 1) G): output
   q + 1 of splitmix64 seeded with key. In torch this is int64 arithmetic, which wraps modulo 2^64 on every device;
   >> on int64 is arithmetic, so each logical shift >>> k masks off the k copied sign bits.
3. a = bits 40..63 of z and b = bits 16..39: two independent 24-bit integers. u = (a + 1) 2^-24 lies in (0, 1];
   the angle is theta = 2 pi (b + 1/2) 2^-24.
4. Box-Muller: rho = sqrt(-2 ln u); element (r, 2j) = (rho x std) cos(theta), element (r, 2j + 1) = (rho x std)
   sin(theta). 24 bits cap |x| at sqrt(-2 ln 2^-24) = 5.77 std; a normal draw exceeds that with probability 8e-9.

ln, cos and sin are evaluated as polynomials in float32 +, -, *, / and sqrt, whose results IEEE 754 fixes to the
bit, in every torch kernel, vectorised or scalar, threaded or not. So an element's value does not depend on the
chunk, the kernel path or the thread count that computed it. torch.log/cos/sin give no such promise (SIMD and libm
versions may differ in the last bit). Integer hashing is exact everywhere.

Each chunk of at most ``pairs_per_chunk`` pairs is computed in place of its slice: temporaries are bounded, and
peak memory is the rank's shard. LayerNorm weights start at 1, every bias and LayerNorm bias at 0 (BLOOM,
transformers' ``_init_weights``): no draw.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from typing import Literal, TypeVar

import torch
from torch import nn

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
MIX1, MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
UNIFORM_BITS = 24  # per uniform: an exact float32 integer, and 2 x 24 bits of the 64-bit hash

# ln(m) = 2 atanh(s) with s = (m - 1) / (m + 1) = 2 (s + s^3/3 + s^5/5 + s^7/7 + s^9/9 + ...). For m in
# [sqrt(1/2), sqrt(2)), |s| <= 0.1716, and the first omitted term, 2 s^11 / 11, is below 7e-10.
_LN_COEFFS = (2 / 9, 2 / 7, 2 / 5, 2 / 3, 2.0)
# Taylor series on |t| <= pi/4: sin to t^9 (next term (pi/4)^11 / 11! = 1.7e-9), cos to t^10 (1.1e-10).
_SIN_COEFFS = (1 / 362880, -1 / 5040, 1 / 120, -1 / 6, 1.0)
_COS_COEFFS = (-1 / 3628800, 1 / 40320, -1 / 720, 1 / 24, -1 / 2, 1.0)

Kind = Literal["ones", "zeros", "normal"]
Seed = int | torch.Generator
ModuleT = TypeVar("ModuleT", bound=nn.Module)


def _to_int64(value: int) -> int:
    """A 64-bit pattern as the signed int64 that torch stores."""
    value &= MASK64
    return value - (1 << 64) if value >> 63 else value


def mix64(z: int) -> int:
    """splitmix64's finaliser on a Python integer (the reference the torch version is checked against)."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    return z ^ (z >> 31)


def seed_value(seed: Seed) -> int:
    """The integer seed; a torch.Generator stands for its initial seed (what manual_seed set), its state unread."""
    return seed.initial_seed() if isinstance(seed, torch.Generator) else int(seed)


def stream_key(seed: int, name: str) -> int:
    """The 64-bit key of one parameter's stream (step 1 of the module docstring)."""
    name_hash = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
    return mix64(mix64(seed + GOLDEN) + name_hash)


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical z >>> bits of int64 bit patterns."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser, in place on a fresh int64 tensor."""
    z ^= _shift_right(z, 30)
    z *= _to_int64(MIX1)
    z ^= _shift_right(z, 27)
    z *= _to_int64(MIX2)
    z ^= _shift_right(z, 31)
    return z


def pair_hashes(pairs: torch.Tensor, key: int) -> torch.Tensor:
    """Step 2: the 64-bit hash (as int64) of each pair index, ``mix(key + (q + 1) G)``."""
    return _mix(pairs * _to_int64(GOLDEN) + _to_int64(key + GOLDEN))


def _horner(x: torch.Tensor, coeffs: Sequence[float]) -> torch.Tensor:
    # Separate multiply and add kernels: a fused multiply-add would round differently from an unfused one.
    out = (x * coeffs[0]).add_(coeffs[1])
    for c in coeffs[2:]:
        out.mul_(x).add_(c)
    return out


def _minus_two_ln(a: torch.Tensor) -> torch.Tensor:
    """-2 ln(a 2^-24) for integers a in [1, 2^24] (exact in float32)."""
    # a = m_a 2^e with m_a in [1, 2), read off the float's IEEE bits (exponent in bits 23..30, biased by 127). Past
    # sqrt(2), halve m_a (exactly) and count one more power of two: m in [sqrt(1/2), sqrt(2)), where the series
    # converges fast. The selection multiplies by 1 or 1/2 and adds 0 or 1, exact (torch.where is slow on CPU).
    bits = a.float().view(torch.int32)
    m_a = ((bits & 0x7FFFFF) | 0x3F800000).view(torch.float32)
    high = (m_a >= math.sqrt(2)).float()
    m = m_a * (1.0 - 0.5 * high)
    e = ((bits >> 23) - (127 + UNIFORM_BITS)).float() + high
    s = (m - 1) / (m + 1)
    ln_u = _horner(s * s, _LN_COEFFS) * s + e * math.log(2)
    return ln_u * -2.0


def _cos_sin(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of theta = 2 pi (b + 1/2) 2^-24 for 24-bit integers b.

    Shifted by an eighth of a turn (2^21), the top two bits count quarter turns k and the rest give the remainder
    t in (-pi/4, pi/4): theta = k pi/2 + t, so (cos, sin)(theta) is (cos t, sin t) turned k quarters.
    """
    shifted = (b.int() + (1 << (UNIFORM_BITS - 3))) & ((1 << UNIFORM_BITS) - 1)
    k = shifted >> (UNIFORM_BITS - 2)
    within = shifted & ((1 << (UNIFORM_BITS - 2)) - 1)
    # (within + 1/2 - 2^21) counts steps of (pi/2) 2^-22 from the middle of the quarter turn.
    t = (within.float() + (0.5 - (1 << (UNIFORM_BITS - 3)))) * (math.pi / 2 / (1 << (UNIFORM_BITS - 2)))
    t2 = t * t
    sin_t = _horner(t2, _SIN_COEFFS) * t
    cos_t = _horner(t2, _COS_COEFFS)
    # Turned k quarters: k = 0: (c, s); 1: (-s, c); 2: (-c, -s); 3: (s, -c). Selecting by multiplying with 0 or 1
    # and adding the 0 is exact (and faster than torch.where on CPU); so is a sign of +-1.
    odd = (k & 1).float()
    even = 1.0 - odd
    cos_sign = 1.0 - 2.0 * ((k ^ (k >> 1)) & 1).float()
    sin_sign = 1.0 - 2.0 * (k >> 1).float()
    return (cos_t * even + sin_t * odd) * cos_sign, (sin_t * even + cos_t * odd) * sin_sign


def normal_pairs(pairs: torch.Tensor, key: int, std: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 2 to 4 for int64 pair indices: two independent N(0, std^2) float32 tensors shaped like ``pairs``,
    (rho std) cos(theta) and (rho std) sin(theta)."""
    z = pair_hashes(pairs, key)
    a = _shift_right(z, 40) + 1
    b = (z >> 16) & ((1 << UNIFORM_BITS) - 1)
    radius = torch.sqrt(_minus_two_ln(a)).mul_(std)
    cos, sin = _cos_sin(b)
    return cos.mul_(radius), sin.mul_(radius)


def default_pairs_per_chunk(device: torch.device) -> int:
    # CPU: 2^16 pairs keep each temporary (0.5 MiB int64) in cache; a GPU wants long kernels (2^22 pairs: about
    # 30 MiB per temporary) so that launch overhead does not dominate.
    return 1 << 16 if device.type == "cpu" else 1 << 22


@torch.no_grad()
def normal_(
    out: torch.Tensor,
    key: int,
    std: float,
    *,
    full_shape: Sequence[int] | None = None,
    offset: Sequence[int] = (0, 0),
    pairs_per_chunk: int | None = None,
) -> torch.Tensor:
    """Fill ``out`` with its elements of the full [R, C] matrix drawn from ``key``: out is full[r0:r0 + rows,
    c0:c0 + cols] for ``offset`` (r0, c0). Returns out."""
    if out.ndim != 2:
        raise ValueError(f"normal_ draws matrices; got a tensor of shape {tuple(out.shape)}")
    rows, cols = out.shape
    if rows == 0 or cols == 0:
        return out
    full_rows, full_cols = tuple(full_shape) if full_shape is not None else (rows, cols)
    row0, col0 = offset
    if not (0 <= row0 <= full_rows - rows and 0 <= col0 <= full_cols - cols):
        raise ValueError(f"slice at {tuple(offset)} of shape {(rows, cols)} lies outside {(full_rows, full_cols)}")
    chunk = pairs_per_chunk or default_pairs_per_chunk(out.device)
    pairs_per_row = (full_cols + 1) // 2
    first_pair, end_pair = col0 // 2, (col0 + cols + 1) // 2  # the pairs that cover columns [col0, col0 + cols)
    pair_step = min(end_pair - first_pair, chunk)
    row_step = max(1, chunk // max(pair_step, 1))
    for r in range(0, rows, row_step):
        r_end = min(rows, r + row_step)
        row_base = torch.arange(row0 + r, row0 + r_end, dtype=torch.int64, device=out.device)[:, None] * pairs_per_row
        for p in range(first_pair, end_pair, pair_step):
            p_end = min(end_pair, p + pair_step)
            pairs = row_base + torch.arange(p, p_end, dtype=torch.int64, device=out.device)
            even, odd = normal_pairs(pairs, key, std)  # columns 2p, 2p + 2, ... and 2p + 1, 2p + 3, ...
            low, high = max(2 * p, col0), min(2 * p_end, col0 + cols)
            target = out[r:r_end, low - col0 : high - col0]
            if (low, high) == (2 * p, 2 * p_end):  # whole pairs: write both halves in place
                interleaved = target.unflatten(1, (p_end - p, 2))
                interleaved[..., 0] = even
                interleaved[..., 1] = odd
            else:
                target.copy_(torch.stack((even, odd), dim=-1).flatten(1)[:, low - 2 * p : high - 2 * p])
    return out


def initial_kind(name: str) -> Kind:
    """What a BLOOM parameter (Hugging Face name) starts as: LayerNorm weights 1, biases 0, matrices N(0, std)."""
    *path, leaf = name.split(".")
    if leaf == "bias":
        return "zeros"
    if leaf == "weight" and path and (path[-1].endswith("layernorm") or path[-1] == "ln_f"):
        return "ones"
    if leaf == "weight":
        return "normal"
    raise ValueError(f"no initial value for parameter {name!r}")


@torch.no_grad()
def init_parameter_(
    param: torch.Tensor,
    name: str,
    *,
    seed: Seed,
    std: float,
    full_shape: Sequence[int] | None = None,
    offset: Sequence[int] | None = None,
) -> None:
    """Set ``param``, which holds full[offset : offset + param.shape] of parameter ``name``, to its initial value."""
    kind = initial_kind(name)
    if kind == "ones":
        param.fill_(1.0)
    elif kind == "zeros":
        param.zero_()
    else:
        if param.ndim != 2:
            raise ValueError(f"{name}: a weight matrix was expected, got shape {tuple(param.shape)}")
        key = stream_key(seed_value(seed), name)
        normal_(param, key, std, full_shape=full_shape, offset=offset or (0, 0))


def empty_module(build: Callable[[], ModuleT], device: torch.device | str) -> ModuleT:
    """``build()`` with its parameters given storage on ``device`` and no values: built on the meta device (so no
    constructor draws a default init nobody keeps), then allocated. The attributes set on parameters
    (``tensor_model_parallel``, ``partition_dim``, ``sequence_parallel``) are carried over, but a parameter shared by
    two modules comes back as two (tie it afterwards); tensors a constructor creates outside parameters and buffers
    must name their device (they would be meta tensors otherwise)."""
    with torch.device("meta"):
        module = build()
    attributes = {name: dict(p.__dict__) for name, p in module.named_parameters(remove_duplicate=False)}
    module.to_empty(device=device)
    for name, param in module.named_parameters(remove_duplicate=False):
        param.__dict__.update(attributes[name])
    return module
