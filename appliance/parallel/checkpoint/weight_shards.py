"""Model weights between the single-process form (Hugging Face names, whole tensors) and this rank's shards.

A checkpoint holds the model either whole, ``model.safetensors`` (tp = pp = 1), or as one file per model-parallel
position, ``model-tp{t}-pp{p}.safetensors``, written by DP rank 0 of that position: Hugging Face names as keys,
each tensor this rank's slice (``role_of_parameter`` says along which dimension), the tied word embedding in
both the first and the last stage's files. ``gather_full_state_dict`` turns either form back into the whole
model on CPU, without any process group, for export and evaluation samples. ``ShardReader`` reads back any
TP rank's slice of any saved tensor, for loading weights and optimizer state at any layout. ``init_shards_`` draws
a rank's slices of the initial weights directly.

A layout with tp2d = q writes the same files, one per mesh rank (tp rank = mesh row * q + mesh column), each holding
its 2D blocks (tensor/param_splits.py), and records ``tp2d`` in the metadata; every reader here rejoins such pieces with
``gather_to_full_2d`` (``join_pieces``), so 2D, 1D and single-process layouts load one another's checkpoints.
BLOOM-MoE at ep > 1 (docs/MOE.md): the model file of a position holds the dense tensors and the experts of ep rank
0; ep rank e >= 1 writes its own experts to ``experts-tp{t}-pp{p}-ep{e}.safetensors`` (layout-free names,
``transformer.h.<block>.mlp.experts.<global index>.*``). Every reader here merges those files in, so the whole
model, and any layout's slices, come back from them as from a dense checkpoint.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from appliance.model.config import BloomConfig
from appliance.model.initial_weights import Seed, init_parameter_
from appliance.parallel.tensor.param_splits import (
    gather_to_full,
    gather_to_full_2d,
    role_of_parameter,
    shard_from_full,
    shard_from_full_2d,
    split_dim,
)

FULL_MODEL_FILE = "model.safetensors"
_SHARD_FILE = re.compile(r"^model-tp(\d+)-pp(\d+)\.safetensors$")
_EXPERT_FILE = re.compile(r"^experts-tp(\d+)-pp(\d+)-ep(\d+)\.safetensors$")


def shard_file_name(tp_rank: int, pp_rank: int) -> str:
    return f"model-tp{tp_rank:02d}-pp{pp_rank:02d}.safetensors"


@torch.no_grad()
def expert_file_name(tp_rank: int, pp_rank: int, ep_rank: int) -> str:
    return f"experts-tp{tp_rank:02d}-pp{pp_rank:02d}-ep{ep_rank:02d}.safetensors"


def expert_files(step_dir: Path) -> list[tuple[int, int, Path]]:
    """(tp_rank, pp_rank, file) of the expert files of ep ranks >= 1 (none for a dense model or ep = 1)."""
    found = []
    for path in sorted(Path(step_dir).iterdir()):
        match = _EXPERT_FILE.match(path.name)
        if match:
            found.append((int(match[1]), int(match[2]), path))
    return found


def _with_experts(step_dir: Path, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # Experts are split over TP like the dense MLP: each (pp, ep) position's files of every TP rank, joined.
    by_position: dict[str, dict[int, Path]] = {}
    for t, _, path in expert_files(step_dir):
        by_position.setdefault(path.name.split("-", 2)[2], {})[t] = path
    for files in by_position.values():
        pieces = [load_file(str(files[t])) for t in sorted(files)]
        for name in pieces[0]:
            full.setdefault(name, join_pieces([p[name] for p in pieces], name, 1))
    return full


def init_shards_(
    named_params: Iterable[tuple[str, torch.Tensor]], config: BloomConfig, seed: Seed, tp_rank: int, tp_size: int
) -> None:
    """Draw this rank's slice of every parameter's initial value into it, in place, on the parameter's device: the
    slice ``shard_from_full`` would cut from ``BloomForCausalLM(config, seed=seed)``, to the bit (each element is a
    function of the seed, the Hugging Face name and its index in the whole tensor: model/initial_weights.py). Only
    the rank's own elements are computed; nothing of the whole model is built."""
    for name, param in named_params:
        role, is_bias = role_of_parameter(name)
        dim = split_dim(role, is_bias=is_bias) if param.ndim else None
        full_shape, offset = list(param.shape), [0] * param.ndim
        if dim is not None:
            # shard_from_full's chunks: rank r of tp holds [r * n, (r + 1) * n) of the tp * n along dim.
            full_shape[dim] *= tp_size
            offset[dim] = tp_rank * param.shape[dim]
        init_parameter_(
            param, name, seed=seed, std=config.initializer_range, full_shape=full_shape, offset=offset or None
        )


@torch.no_grad()
def init_mesh_blocks_(
    named_params: Iterable[tuple[str, torch.Tensor]], config: BloomConfig, seed: Seed, row: int, col: int, q: int
) -> None:
    """``init_shards_`` for a tp2d rank at (``row``, ``col``) of the q x q mesh: the block
    tensor.param_splits.shard_from_full_2d would cut, drawn directly (a matrix's block [dim0 slice col, dim1 slice row],
    a vector's slice col)."""
    for name, param in named_params:
        full_shape = [size * q for size in param.shape]
        offset = [col * param.shape[0]] + ([row * param.shape[1]] if param.ndim == 2 else [])
        init_parameter_(param, name, seed=seed, std=config.initializer_range, full_shape=full_shape, offset=offset)


def shard_files(step_dir: Path) -> dict[tuple[int, int], Path]:
    """(tp_rank, pp_rank) -> file, for the sharded form."""
    found = {}
    for path in Path(step_dir).iterdir():
        match = _SHARD_FILE.match(path.name)
        if match:
            found[(int(match[1]), int(match[2]))] = path
    return found


def join_pieces(pieces: list[torch.Tensor], name: str, tp2d: int = 1) -> torch.Tensor:
    """The whole tensor ``name`` from its pieces in tp rank order: 1D slices along the role's dimension, or with
    tp2d = q the q x q mesh's blocks."""
    if tp2d > 1:
        return gather_to_full_2d([pieces[row * tp2d : (row + 1) * tp2d] for row in range(tp2d)])
    role, is_bias = role_of_parameter(name)
    return gather_to_full(pieces, role, is_bias=is_bias)


def _tp2d_of(paths: Iterable[Path]) -> int:
    """The tp2d the files were written at (1: a 1D or single-process layout); files must agree."""
    found = set()
    for path in paths:
        with safe_open(str(path), framework="pt") as f:
            found.add(int((f.metadata() or {}).get("tp2d", 1)))
    if len(found) > 1:
        raise ValueError(f"files written at different tp2d sizes {sorted(found)}")
    return found.pop() if found else 1


def assemble_full(
    shards: Mapping[tuple[int, int], Mapping[str, torch.Tensor]], tp2d: int = 1
) -> dict[str, torch.Tensor]:
    """The whole model from every (tp_rank, pp_rank) position's shard (Hugging Face names).

    TP-replicated tensors must agree across TP ranks and the tied embedding across its two stages: a difference
    is drift, reported, never averaged away.
    """
    tp = 1 + max(t for t, _ in shards)
    pp = 1 + max(p for _, p in shards)
    missing = [shard_file_name(t, p) for t in range(tp) for p in range(pp) if (t, p) not in shards]
    if missing:
        raise FileNotFoundError(f"shards missing: {', '.join(missing)}")
    full: dict[str, torch.Tensor] = {}
    for p in range(pp):
        stage = [shards[(t, p)] for t in range(tp)]
        for name in stage[0]:
            tensor = join_pieces([s[name] for s in stage], name, tp2d)
            if name not in full:
                full[name] = tensor
            elif not torch.equal(full[name], tensor):
                raise ValueError(f"{name} differs between pipeline stage 0 and stage {p}")
    return full


def gather_full_state_dict(step_dir: Path) -> dict[str, torch.Tensor]:
    """The whole model, Hugging Face names to CPU tensors, from a checkpoint directory in either form."""
    step_dir = Path(step_dir)
    if (step_dir / FULL_MODEL_FILE).is_file():
        return _with_experts(step_dir, load_file(str(step_dir / FULL_MODEL_FILE)))
    files = shard_files(step_dir)
    if not files:
        raise FileNotFoundError(f"{step_dir}: neither {FULL_MODEL_FILE} nor model-tp*-pp*.safetensors")
    try:
        tp2d = _tp2d_of(files.values())
        full = assemble_full({position: load_file(str(path)) for position, path in files.items()}, tp2d)
        return _with_experts(step_dir, full)
    except (FileNotFoundError, ValueError) as e:
        raise type(e)(f"{step_dir}: {e}") from e


def model_sources(step_dir: Path) -> list[tuple[int, int, Path]]:
    """(tp_rank, pp_rank, file) of every model file of a checkpoint, in either form."""
    step_dir = Path(step_dir)
    if (step_dir / FULL_MODEL_FILE).is_file():
        return [(0, 0, step_dir / FULL_MODEL_FILE), *expert_files(step_dir)]
    files = shard_files(step_dir)
    if not files:
        raise FileNotFoundError(f"{step_dir}: neither {FULL_MODEL_FILE} nor model-tp*-pp*.safetensors")
    return [(t, p, path) for (t, p), path in sorted(files.items())] + expert_files(step_dir)


class ShardReader:
    """Tensors saved as tensor-parallel pieces across files, read back as any TP rank's slice.

    ``sources`` are (tp_rank, pp_rank, file); several files may share a position (each holding some of its
    tensors). A key held by several pipeline stages (the tied word embedding) is read from the first stage that
    holds it. Indexing reads only the files' headers, and ``read`` takes from each piece only the rows or columns
    the asking rank keeps: loading at any layout costs the memory of the rank's own slice, never the whole tensor
    (at BLOOM-176B the whole word embedding is 250,880 x 14,336 x 4 B = 14 GB; a tp=4 slice is 3.6 GB).
    Keys are Hugging Face parameter names, optionally with a suffix (``<name>.exp_avg``); the parameter's name
    says how it splits over TP (``role_of_parameter``), and 0-d tensors are never split.
    """

    def __init__(self, sources: Iterable[tuple[int, int, Path]], *, what: str) -> None:
        self.what = what
        by_stage: dict[int, dict[str, dict[int, Path]]] = {}
        saved_tp: set[int] = set()
        for t, p, path in sources:
            with safe_open(str(path), framework="pt") as f:
                saved_tp.add(int((f.metadata() or {}).get("tp", 0)))
                for key in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                    by_stage.setdefault(p, {}).setdefault(key, {})[t] = path
        if not by_stage:
            raise FileNotFoundError(f"{what}: no tensors")
        # The writers record their layout's tp; files written without it count their TP ranks.
        counted = 1 + max(t for stage in by_stage.values() for pieces in stage.values() for t in pieces)
        recorded = saved_tp - {0}
        if len(recorded) > 1:
            raise ValueError(f"{what}: files written at different tp sizes {sorted(recorded)}")
        self.tp = recorded.pop() if recorded else counted
        self.tp2d = _tp2d_of(path for _, _, path in sources)
        self._files: dict[str, list[Path]] = {}  # key -> its file on each TP rank, in TP order
        for p in sorted(by_stage):
            for key, pieces in by_stage[p].items():
                if key in self._files:
                    continue
                missing = [t for t in range(self.tp) if t not in pieces]
                if missing:
                    raise FileNotFoundError(f"{what}: {key} of pipeline stage {p} lacks tp rank(s) {missing}")
                self._files[key] = [pieces[t] for t in range(self.tp)]

    def keys(self) -> list[str]:
        return list(self._files)

    def __contains__(self, key: object) -> bool:
        return key in self._files

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def read(self, key: str, param_name: str, tp_rank: int, tp_size: int) -> torch.Tensor:
        """Rank ``tp_rank`` of ``tp_size``'s slice of tensor ``key``, which belongs to parameter ``param_name``:
        what ``shard_from_full`` would cut from the whole tensor, whatever tp the files were written at."""
        if key not in self._files:
            raise KeyError(f"{self.what}: no tensor {key}")
        role, is_bias = role_of_parameter(param_name)
        if self.tp2d > 1:  # 2D blocks: the whole tensor, then this rank's slice (a 2D rank's memory is the whole)
            whole = self._whole_2d(key, param_name)
            return whole if not whole.ndim else shard_from_full(whole, role, tp_rank, tp_size, is_bias=is_bias)
        with ExitStack() as stack:
            handles = [stack.enter_context(safe_open(str(path), framework="pt")) for path in self._files[key]]
            pieces = [handle.get_slice(key) for handle in handles]
            shape = pieces[0].get_shape()
            dim = split_dim(role, is_bias=is_bias) if shape else None
            if dim is None:  # replicated across TP ranks: every piece is the whole tensor
                return handles[0].get_tensor(key)
            sizes = [piece.get_shape()[dim] for piece in pieces]
            total = sum(sizes)
            if total % tp_size:
                raise ValueError(f"{self.what}: {key}: {total} along dimension {dim} does not split over tp({tp_size})")
            # This rank keeps [start, stop) of the whole dimension; piece i holds [offset_i, offset_i + size_i).
            start, stop = tp_rank * total // tp_size, (tp_rank + 1) * total // tp_size
            parts, offset = [], 0
            for piece, size in zip(pieces, sizes, strict=True):
                low, high = max(start, offset), min(stop, offset + size)
                if low < high:
                    index = (slice(None),) * dim + (slice(low - offset, high - offset),)
                    parts.append(piece[index])
                offset += size
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)

    def _whole_2d(self, key: str, param_name: str) -> torch.Tensor:
        pieces = []
        for path in self._files[key]:
            with safe_open(str(path), framework="pt") as f:
                pieces.append(f.get_tensor(key))
        return pieces[0] if not pieces[0].ndim else join_pieces(pieces, param_name, self.tp2d)

    def read_block(self, key: str, param_name: str, row: int, col: int, q: int) -> torch.Tensor:
        """Mesh rank (``row``, ``col``)'s block of tensor ``key`` at tp2d = q (tensor.param_splits.shard_from_full_2d),
        from files of any layout; 0-d tensors whole."""
        whole = self._whole_2d(key, param_name) if self.tp2d > 1 else self.read(key, param_name, 0, 1)
        return whole if not whole.ndim else shard_from_full_2d(whole, row, col, q)


class LazyFullStateDict(Mapping[str, torch.Tensor]):
    """The whole model's tensors (Hugging Face names), each read from the checkpoint files when asked for.

    Exporting through this mapping holds one parameter (its TP pieces joined) and one output shard at a time,
    never the model: the export of a 176B checkpoint saved at tp=4, pp=12 fits on a head node. A tensor that
    several pipeline stages hold (the tied word embedding) is read from the first stage that has it.
    """

    def __init__(self, step_dir: Path) -> None:
        step_dir = Path(step_dir)
        if (step_dir / FULL_MODEL_FILE).is_file():
            sources = {(0, 0): step_dir / FULL_MODEL_FILE}
        else:
            sources = shard_files(step_dir)
        if not sources:
            raise FileNotFoundError(f"{step_dir}: neither {FULL_MODEL_FILE} nor model-tp*-pp*.safetensors")
        tp = 1 + max(t for t, _ in sources)
        pp = 1 + max(p for _, p in sources)
        missing = [shard_file_name(t, p) for t in range(tp) for p in range(pp) if (t, p) not in sources]
        if missing:
            raise FileNotFoundError(f"{step_dir}: shards missing: {', '.join(missing)}")
        self._files: dict[str, list[Path]] = {}  # name -> the file of each TP rank, in TP order
        self._tp2d = _tp2d_of(sources.values())
        for p in range(pp):
            stage = [sources[(t, p)] for t in range(tp)]
            with safe_open(str(stage[0]), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                    self._files.setdefault(name, stage)
        experts: dict[str, dict[int, Path]] = {}  # (pp, ep) position -> its file on each TP rank
        for t, _, path in expert_files(step_dir):
            experts.setdefault(path.name.split("-", 2)[2], {})[t] = path
        for files in experts.values():
            with safe_open(str(files[0]), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                    self._files.setdefault(name, [files[t] for t in sorted(files)])

    def __getitem__(self, name: str) -> torch.Tensor:
        pieces = []
        for path in self._files[name]:
            with safe_open(str(path), framework="pt") as f:
                pieces.append(f.get_tensor(name))
        return join_pieces(pieces, name, self._tp2d)

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)
