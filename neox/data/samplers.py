"""Resumable pretraining sampler: this data-parallel rank's share of each global micro-batch."""

from __future__ import annotations

import logging
from collections.abc import Iterator

logger = logging.getLogger(__name__)


class PretrainingSampler:
    """Endless micro-batches of sample indices for one data-parallel rank, from `consumed_samples`.

    The global stream is 0, 1, 2, ... (modulo `total_samples`); each global micro-batch of
    `micro_batch_size * data_parallel_size` consecutive positions is cut into contiguous
    per-rank slices. What is served is a pure function of the position, so a run resumed at
    `consumed_samples=k` sees exactly what the uninterrupted run saw from position k on.
    Past the end of the dataset the stream wraps around (logged once) instead of stopping, so a
    training loop never meets StopIteration.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
    ):
        if total_samples <= 0:
            raise ValueError(f"the dataset has no samples (total_samples={total_samples})")
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples must be >= 0, got {consumed_samples}")
        if micro_batch_size <= 0:
            raise ValueError(f"micro_batch_size must be positive, got {micro_batch_size}")
        if data_parallel_size <= 0 or not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(
                f"data_parallel_rank={data_parallel_rank} must lie in [0, data_parallel_size="
                f"{data_parallel_size})"
            )
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size

    @property
    def global_micro_batch_size(self) -> int:
        """Samples consumed by all data-parallel ranks per micro-batch."""
        return self.micro_batch_size * self.data_parallel_size

    def __iter__(self) -> Iterator[list[int]]:
        start = self.consumed_samples + self.data_parallel_rank * self.micro_batch_size
        warned = False
        while True:
            batch = [(start + i) % self.total_samples for i in range(self.micro_batch_size)]
            if not warned and start + self.micro_batch_size > self.total_samples:
                warned = True
                logger.warning(
                    "sampler passed the end of its %d samples at position %d; wrapping around "
                    "(the dataset was built for fewer samples than are being consumed)",
                    self.total_samples,
                    start,
                )
            yield batch
            start += self.global_micro_batch_size
