"""The pretraining sampler: Megatron's MegatronPretrainingSampler, resumable and independent of DP size.

The global order of samples is fixed: 0, 1, 2, ... (the datasets already shuffle). Training consumes them in
groups of micro_batch_size * dp_size; rank r takes slice [r * mbs, (r + 1) * mbs) of each group. A run that
stopped after `consumed_samples` resumes at exactly that sample, and because the order does not depend on the
layout, resuming with another dp_size (or micro batch) continues the same global sequence:

    dp=4, mbs=2, 3 steps of 1 micro batch: samples 0..23 consumed -> checkpoint says consumed_samples=24
    resume with dp=2, mbs=2: the first micro step takes 24..27 (rank 0: 24,25; rank 1: 26,27), and so on.

Any consumed_samples is accepted (the trainer advances it by whole global batches); the next group starts at it.

BalancedPretrainingSampler (reset_attention_mask): the same samples step by step, each step's global batch placed on
the ranks and their micro-batches by the samples' attention cost (balance.py). It needs the step boundaries, so it
takes the batch size as a function of consumed_samples (the ramp-up); a step starts at a checkpoint's
consumed_samples, so a resumed run places the same samples on the same ranks. Its placement depends on dp_size:
resuming with another dp_size consumes the same samples per step, differently placed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from appliance.data.balance import place_samples


def check_position(
    total_samples: int, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int
) -> None:
    """ValueError naming the value when a sampler's position or batch arguments cannot describe a run."""
    if total_samples <= 0:
        raise ValueError(f"no sample to consume: total_samples={total_samples}")
    if not 0 <= consumed_samples <= total_samples:
        raise ValueError(f"consumed_samples={consumed_samples} outside [0, total_samples={total_samples}]")
    if micro_batch_size <= 0 or dp_size <= 0:
        raise ValueError(f"micro_batch_size ({micro_batch_size}) and dp_size ({dp_size}) must be positive")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} must lie in [0, dp_size={dp_size})")


class PretrainingSampler:
    """Yields this DP rank's micro batches (lists of global sample indices), from consumed_samples on."""

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        drop_last: bool = True,
    ) -> None:
        check_position(total_samples, consumed_samples, micro_batch_size, dp_rank, dp_size)
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.drop_last = drop_last

    @property
    def group_size(self) -> int:
        """Samples one micro step consumes across all DP ranks."""
        return self.micro_batch_size * self.dp_size

    def __len__(self) -> int:
        """Micro batches this rank will yield."""
        remaining = self.total_samples - self.consumed_samples
        full, rest = divmod(remaining, self.group_size)
        # A last partial group (drop_last=False) gives this rank a batch only if its slice is not empty.
        partial = not self.drop_last and rest > self.dp_rank * self.micro_batch_size
        return full + int(partial)

    def __iter__(self) -> Iterator[list[int]]:
        first = self.dp_rank * self.micro_batch_size
        for start in range(self.consumed_samples, self.total_samples, self.group_size):
            end = start + self.group_size
            if end > self.total_samples:
                if self.drop_last:
                    return
                end = self.total_samples
            mine = list(range(start, end))[first : first + self.micro_batch_size]
            if mine:
                yield mine


class BalancedPretrainingSampler:
    """Yields this DP rank's micro batches, step after step from consumed_samples: each step's samples
    [consumed, consumed + batch) placed by balance.place_samples on their costs. Stops before a step that
    total_samples cannot fill."""

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        *,
        batch_size_at: Callable[[int], int],
        sample_cost: Callable[[int], float],
    ) -> None:
        check_position(total_samples, consumed_samples, micro_batch_size, dp_rank, dp_size)
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.batch_size_at = batch_size_at
        self.sample_cost = sample_cost

    def __iter__(self) -> Iterator[list[int]]:
        consumed = self.consumed_samples
        group = self.micro_batch_size * self.dp_size
        while True:
            batch = self.batch_size_at(consumed)
            if batch % group:
                raise ValueError(
                    f"the step at consumed_samples={consumed} has a batch of {batch}, not a multiple of "
                    f"micro_batch_size({self.micro_batch_size}) x dp_size({self.dp_size})"
                )
            if consumed + batch > self.total_samples:
                return
            indices = list(range(consumed, consumed + batch))
            placement = place_samples(indices, [self.sample_cost(i) for i in indices], self.dp_size, batch // group)
            yield from placement[self.dp_rank]
            consumed += batch
