"""Which samples form each global batch, and which of them a worker trains on.

The global batch at iteration i is a function of (seed, i) only: sample
positions i*B .. i*B+B-1 of an endless stream made of one seeded permutation of
the dataset per epoch. The world size only decides how that batch is cut into
shards, so resizing never changes what the model sees.
"""

from __future__ import annotations

import torch


def _epoch_permutation(seed: int, epoch: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed((seed * 1_000_003 + epoch) % (2**63 - 1))
    return torch.randperm(n, generator=g)


def batch_indices(seed: int, iteration: int, global_batch: int, dataset_size: int) -> torch.Tensor:
    """Dataset indices of the global batch trained at `iteration` (0-based)."""
    if dataset_size < 1 or global_batch < 1 or iteration < 0:
        raise ValueError("dataset_size and global_batch must be positive, iteration non-negative")
    start = iteration * global_batch
    stop = start + global_batch
    parts = []
    pos = start
    while pos < stop:
        epoch, offset = divmod(pos, dataset_size)
        take = min(stop - pos, dataset_size - offset)
        parts.append(_epoch_permutation(seed, epoch, dataset_size)[offset : offset + take])
        pos += take
    return torch.cat(parts)


def shard_bounds(global_batch: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, stop) of rank's shard: sizes differ by at most one when B % W != 0."""
    base, extra = divmod(global_batch, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def micro_batches(start: int, stop: int, max_micro_batch: int | None) -> list[tuple[int, int]]:
    """Split a shard into gradient-accumulation steps of at most `max_micro_batch` samples."""
    size = stop - start
    step = size if not max_micro_batch else max_micro_batch
    return [(s, min(s + step, stop)) for s in range(start, stop, max(step, 1))]
