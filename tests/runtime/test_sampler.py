import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flows.training.rank.sampler import batch_indices, micro_batches, shard_bounds


@given(
    seed=st.integers(0, 1000),
    iteration=st.integers(0, 500),
    batch=st.integers(1, 64),
    size=st.integers(1, 200),
)
@settings(max_examples=60, deadline=None)
def test_global_batch_depends_on_seed_and_iteration_only(seed: int, iteration: int, batch: int, size: int) -> None:
    first = batch_indices(seed, iteration, batch, size)
    assert torch.equal(first, batch_indices(seed, iteration, batch, size))
    assert len(first) == batch
    assert int(first.min()) >= 0 and int(first.max()) < size


@given(batch=st.integers(1, 97), world=st.integers(1, 16), micro=st.one_of(st.none(), st.integers(1, 9)))
def test_shards_partition_the_global_batch(batch: int, world: int, micro: int | None) -> None:
    if world > batch:
        world = batch
    covered: list[int] = []
    sizes = []
    for rank in range(world):
        start, stop = shard_bounds(batch, world, rank)
        sizes.append(stop - start)
        for a, b in micro_batches(start, stop, micro):
            assert micro is None or b - a <= micro
            covered.extend(range(a, b))
    assert covered == list(range(batch))
    assert max(sizes) - min(sizes) <= 1


def test_every_sample_once_per_epoch() -> None:
    seen = torch.cat([batch_indices(3, it, 10, 50) for it in range(5)])
    assert sorted(seen.tolist()) == list(range(50))
    next_epoch = torch.cat([batch_indices(3, it, 10, 50) for it in range(5, 10)])
    assert not torch.equal(seen, next_epoch)  # a fresh permutation each epoch
