"""Scoring through a tensor- and pipeline-parallel model: the TaskModel the evaluation harness calls
(appliance/eval/harness.py), for any layout.

Every rank of one model replica (its TP x PP ranks) is called with the same batch; the DP replicas score different
requests (the harness splits them over the DP group). With context parallelism each CP rank scores whole sequences
on its own, the cp attention core switched off (context/training.py says why). A forward runs stage by stage: the
first stage embeds the ids, each stage runs its layers and sends the hidden states to the next (a shape message,
then the tensor), and the last stage holds this TP rank's vocabulary slice of the logits. The log-softmax and the
argmax over the whole vocabulary come from three small all-reduces over TP (the max, the sum of exponentials with
the target's logit, the argmax), never from the full logits; the last stage then broadcasts the answer to the other
stages.

At tp2d (a Q x Q mesh per stage, tensor2d/layers2d.py) the batch is padded with rows to a multiple of Q, each mesh row
scores its batch slice with the vocabulary-parallel scores over the row (the vocabulary is split over the columns), and
an all-gather along the mesh column puts the slices back together on every rank.

Batches may have any length: with sequence parallelism the sequence is padded on the right to a multiple of tp,
which a causal model never sees from earlier positions. Left-padded rows (generation) are run per prompt length,
since the pipeline blocks take no attention mask.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from appliance.parallel.context.training import whole_sequences
from appliance.parallel.tensor.cross_entropy import HeadInput, vocab_parallel_scores
from appliance.parallel.tensor2d.layers2d import Mesh2D
from appliance.parallel.tensor2d.summa import gather_whole_grad
from appliance.parallel.topology import ParallelTopology


class ParallelScorer:
    """target_logprobs and next_tokens (appliance/eval/scoring.py's contract) over one replica's ranks."""

    def __init__(
        self, module: torch.nn.Module, topology: ParallelTopology, device: torch.device, mesh: Mesh2D | None = None
    ) -> None:
        self.module, self.topology, self.device = module, topology, device
        self.mesh = mesh  # tp2d: each mesh row scores its batch slice over the row (see the module docstring)
        self.score_group = mesh.row_group if mesh is not None else topology.tp_group
        self.pp_rank, self.dp_rank, self.tp_rank = topology.coords(dist.get_rank())
        self.first, self.last = self.pp_rank == 0, self.pp_rank == topology.pp - 1
        self.dtype = next(module.parameters()).dtype

    def _peer(self, stage: int) -> int:
        return self.topology.rank_with(dist.get_rank(), pp=stage)

    def _head(self, input_ids: torch.Tensor) -> HeadInput | None:
        """The last stage's final hidden states [B, S, H] and embedding shard (no logits); None on the others."""
        seq = input_ids.shape[1]
        padded = -(-seq // self.topology.tp) * self.topology.tp
        rows = input_ids.shape[0]
        if self.mesh is not None:
            rows = -(-rows // self.mesh.q) * self.mesh.q  # the mesh rows split the batch
        x = torch.nn.functional.pad(input_ids, (0, padded - seq, 0, rows - input_ids.shape[0])).to(self.device)
        if not self.first:
            shape = torch.empty(3, dtype=torch.int64, device=self.device)
            dist.recv(shape, self._peer(self.pp_rank - 1))
            x = torch.empty(*shape.tolist(), dtype=self.dtype, device=self.device)
            dist.recv(x, self._peer(self.pp_rank - 1))
        was_training = self.module.training
        self.module.eval()
        try:
            with whole_sequences(self.module):  # every CP rank scores alone (context/training.py says why)
                out = self.module(x)
        finally:
            self.module.train(was_training)
        if not self.last:
            dist.send(torch.tensor(out.shape, dtype=torch.int64, device=self.device), self._peer(self.pp_rank + 1))
            dist.send(out.contiguous(), self._peer(self.pp_rank + 1))
            return None
        return HeadInput(out.hidden[:, :seq], out.weight)

    def _row_slice(self, tensor: torch.Tensor) -> torch.Tensor:
        """tp2d: this mesh row's slice of a whole-batch tensor, padded as _head pads the ids."""
        if self.mesh is None:
            return tensor
        rows = -(-tensor.shape[0] // self.mesh.q) * self.mesh.q
        padded = torch.nn.functional.pad(tensor, (0, 0) * (tensor.ndim - 1) + (0, rows - tensor.shape[0]))
        return self.mesh.batch_slice(padded)

    def _whole_batch(self, part: torch.Tensor, rows: int) -> torch.Tensor:
        """tp2d: the mesh rows' slices along dimension 0 gathered over the mesh column, the padding rows dropped."""
        if self.mesh is None:
            return part
        return gather_whole_grad(part.contiguous(), 0, self.mesh.col_group)[:rows]

    def _from_last_stage(self, result: torch.Tensor) -> torch.Tensor:
        if self.topology.pp > 1:
            dist.broadcast(result, src=self._peer(self.topology.pp - 1), group=self.topology.pp_group)
        return result.cpu()

    @torch.no_grad()
    def target_logprobs(self, input_ids: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(log p(target) [B, S], target == greedy argmax [B, S]) for right-padded rows."""
        head = self._head(input_ids)
        result = torch.empty(2, *input_ids.shape, dtype=torch.float32, device=self.device)
        if head is not None:
            targets = self._row_slice(targets.to(self.device))
            logprobs, argmax = vocab_parallel_scores(head, targets, self.score_group)
            assert logprobs is not None
            rows = input_ids.shape[0]
            result[0] = self._whole_batch(logprobs.float(), rows)
            result[1] = self._whole_batch((argmax == targets).float(), rows)
        result = self._from_last_stage(result)
        return result[0], result[1].bool()

    @torch.no_grad()
    def next_tokens(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The argmax next token [B] of left-padded rows; rows of equal length run together without padding."""
        lengths = attention_mask.to(torch.int64).sum(dim=1)
        out = torch.empty(input_ids.shape[0], dtype=torch.int64, device=self.device)
        for length in sorted(set(lengths.tolist())):
            rows = (lengths == length).nonzero().squeeze(1)
            head = self._head(input_ids[rows, input_ids.shape[1] - length :])
            if head is not None:
                last = HeadInput(head.hidden[:, -1], head.weight)
                _, argmax = vocab_parallel_scores(last, None, self.score_group)
                out[rows.to(self.device)] = self._whole_batch(argmax, len(rows))
        return self._from_last_stage(out)
