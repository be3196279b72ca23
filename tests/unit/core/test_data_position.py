"""ddp_sigterm.DataPosition without processes: each rank's loader is made with its rank and number of ranks given to
its DistributedSampler, as a job's ranks make theirs; the saved position is rank 0's, as a checkpoint holds it. The
jobs themselves are in tests/test_data_position.py."""

from __future__ import annotations

import logging
from collections import Counter

import pytest
from torch.utils.data import DataLoader, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from ddp_sigterm import DataPosition

SAMPLES, BATCH = 50, 4


def loader(kind: type, world: int, rank: int) -> DataLoader:
    return kind(range(SAMPLES), batch_size=BATCH, sampler=DistributedSampler(range(SAMPLES), world, rank, seed=3))


def stopped(kind: type, world: int, epoch: int, batches: int) -> tuple[dict, list[int]]:
    """Every rank trains ``batches`` batches of ``epoch``: rank 0's saved position, and what the ranks trained."""
    trained, saved = [], None
    for rank in range(world):
        position = DataPosition(loader(kind, world, rank))
        for _ in range(epoch):  # the epochs before
            list(position.epoch(_))
        for done, batch in enumerate(position.epoch(epoch), 1):
            trained += batch.tolist()
            if done == batches:
                break
        saved = position.state_dict() if rank == 0 else saved
    return saved, trained


@pytest.mark.parametrize("kind", [DataLoader, StatefulDataLoader])
def test_on_the_same_ranks_each_rank_gets_the_batches_it_would_have_had(kind: type) -> None:
    saved, _ = stopped(kind, 2, epoch=1, batches=3)
    for rank in range(2):
        uninterrupted = DataPosition(loader(kind, 2, rank))
        expected = [batch.tolist() for batch in uninterrupted.epoch(1)][3:]
        resumed = DataPosition(loader(kind, 2, rank))
        resumed.load_state_dict(saved)
        assert [batch.tolist() for batch in resumed.epoch(1)] == expected
        assert [batch.tolist() for batch in resumed.epoch(2)] == [batch.tolist() for batch in uninterrupted.epoch(2)]


@pytest.mark.parametrize("kind", [DataLoader, StatefulDataLoader])
@pytest.mark.parametrize(("before", "after"), [(3, 2), (2, 3), (2, 1)])
def test_on_other_ranks_the_rest_of_the_epoch_comes_once(kind: type, before: int, after: int, caplog) -> None:
    saved, trained = stopped(kind, before, epoch=1, batches=2)
    rest = []
    with caplog.at_level(logging.WARNING, logger="ddp_sigterm"):
        for rank in range(after):
            resumed = DataPosition(loader(kind, after, rank))
            resumed.load_state_dict(saved)
            rest += [sample for batch in resumed.epoch(1) for sample in batch.tolist()]
            assert len({len(list(resumed.epoch(2)))}) == 1  # the next epoch: the new ranks' own
    counts = Counter(trained + rest)
    # DistributedSampler pads the epoch to a multiple of the ranks: samples of the padding come twice
    assert set(counts) == set(range(SAMPLES))
    padding = -SAMPLES % before + -len(set(range(SAMPLES)) - set(trained)) % after
    assert sum(counts.values()) - SAMPLES <= padding
    said = [record.getMessage() for record in caplog.records]
    assert any(f"resumed on {after} data-parallel ranks where it stopped on {before}" in line for line in said)


def test_a_sampler_that_is_not_distributed_starts_the_epoch_over_on_other_ranks(caplog) -> None:
    position = DataPosition(StatefulDataLoader(range(SAMPLES), batch_size=BATCH, shuffle=True))
    for done, _ in enumerate(position.epoch(0), 1):
        if done == 2:
            break
    saved = {**position.state_dict(), "world_size": 2}  # as if two ranks had each drawn it
    resumed = DataPosition(StatefulDataLoader(range(SAMPLES), batch_size=BATCH, shuffle=True))
    resumed.load_state_dict(saved)
    with caplog.at_level(logging.WARNING, logger="ddp_sigterm"):
        again = [sample for batch in resumed.epoch(0) for sample in batch.tolist()]
    assert sorted(again) == list(range(SAMPLES))  # the whole epoch
    (said,) = [r.getMessage() for r in caplog.records if "cannot be carried" in r.getMessage()]
    assert "from 2 ranks to 1 (its sampler, RandomSampler, is not distributed): the epoch starts over" in said
