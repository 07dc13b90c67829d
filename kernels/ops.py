"""Every op the registry dispatches, declared once: its kernel module, its signature, its shape and dtype rule, and
what it returns.

Three functions carry each op under its name: the registry's switch (registry.py), the pure-torch twin
(reference.py) and the Triton launcher of the kernel module named here. Each must have exactly the declared
signature (names, order, kinds, defaults, annotations as written): tests/kernels/test_op_signatures.py compares
them with `inspect`, and the registry reads the modules from this table (kernels/backend_env.py KERNEL_MODULES). A
new op is an entry here, its twin, its kernel module and its registry function.
"""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass


@dataclass(frozen=True)
class Op:
    module: str  # kernels/<module>.py holds the Triton launcher
    arguments: str  # the parameter list, as written in a def
    returns: str  # the return annotation, as written
    shapes: str  # shapes and dtypes in, shapes and dtypes out

    def signature(self) -> inspect.Signature:
        """The declared signature, annotations as strings (every kernels module uses postponed annotations)."""
        stub = ast.parse(f"def op({self.arguments}) -> {self.returns}: ...").body[0]
        assert isinstance(stub, ast.FunctionDef)
        args = stub.args
        defaults = [None] * (len(args.args) - len(args.defaults)) + list(args.defaults)
        params = [_parameter(a, d, keyword_only=False) for a, d in zip(args.args, defaults, strict=True)]
        params += [_parameter(a, d, keyword_only=True) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)]
        returns = ast.unparse(stub.returns) if stub.returns is not None else inspect.Signature.empty
        return inspect.Signature(params, return_annotation=returns)


def _parameter(arg: ast.arg, default: ast.expr | None, *, keyword_only: bool) -> inspect.Parameter:
    kind = inspect.Parameter.KEYWORD_ONLY if keyword_only else inspect.Parameter.POSITIONAL_OR_KEYWORD
    value = inspect.Parameter.empty if default is None else ast.literal_eval(default)
    annotation = ast.unparse(arg.annotation) if arg.annotation is not None else inspect.Parameter.empty
    return inspect.Parameter(arg.arg, kind, default=value, annotation=annotation)


_ATTENTION_KEYWORDS = (
    "q_offset: int | None = None, k_offset: int = 0, q_doc: torch.Tensor | None = None, "
    "k_doc: torch.Tensor | None = None"
)

OPS: dict[str, Op] = {
    "layer_norm": Op(
        "layer_norm",
        "x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5",
        "torch.Tensor",
        "x [..., H], weight and bias [H]; out like x (shape and dtype), statistics in fp32",
    ),
    "bias_gelu": Op(
        "bias_gelu",
        "x: torch.Tensor, bias: torch.Tensor",
        "torch.Tensor",
        "x [..., F], bias [F]; out gelu_tanh(x + bias) like x, math in fp32",
    ),
    "alibi_softmax": Op(
        "softmax",
        "scores: torch.Tensor, slopes: torch.Tensor, padding_mask: torch.Tensor | None = None, scale: float = 1.0, "
        "causal: bool = True",
        "torch.Tensor",
        "scores [b, h, q_len, k_len], slopes [h] fp32, padding_mask [b, k_len] (nonzero: a real token); out like "
        "scores, math in fp32",
    ),
    "flash_alibi_attention": Op(
        "flash_attention",
        "q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor, causal: bool = True, "
        f"scale: float | None = None, *, {_ATTENTION_KEYWORDS}, return_lse: bool = False",
        "torch.Tensor | tuple[torch.Tensor, torch.Tensor]",
        "q [b, h, q_len, d], k and v [b, h, k_len, d], slopes [h], q_doc [b, q_len], k_doc [b, k_len]; out like q, "
        "with return_lse also the natural-log logsumexp [b, h, q_len] fp32 (no gradient)",
    ),
    "flash_alibi_attention_backward": Op(
        "flash_attention",
        "do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor, "
        f"delta: torch.Tensor, slopes: torch.Tensor, scale: float, *, causal: bool = True, {_ATTENTION_KEYWORDS}",
        "tuple[torch.Tensor, torch.Tensor, torch.Tensor]",
        "do like q; lse and delta [b, h, q_len] fp32 (natural log, merged over every key chunk); out dq, dk, dv "
        "like q, k, v",
    ),
    "vocab_cross_entropy": Op(
        "cross_entropy",
        "hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, chunk_size: int | None = None, "
        'ignore_index: int = -100, tp_group: dist.ProcessGroup | None = None, reduction: str = "mean"',
        "torch.Tensor",
        "hidden [..., H], weight [V_local, H] (this rank's vocab shard), labels [...] int64 global ids; out a "
        "scalar fp32 loss (reduction none: fp32 like labels)",
    ),
    "vocab_scores": Op(
        "cross_entropy",
        "hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor | None, *, chunk_size: int | None = None, "
        "tp_group: dist.ProcessGroup | None = None",
        "tuple[torch.Tensor | None, torch.Tensor]",
        "hidden [..., H], weight [V_local, H], targets [...] or None; out (log p(target) [...] fp32 or None, "
        "greedy token [...] int64)",
    ),
}
