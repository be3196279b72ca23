"""The rest of a stopped epoch on any number of ranks (ddp_sigterm._core.epoch_order), without processes: the order a
distributed sampler deals, what a resume deals of it, and the sampler that deals it through a real loader. The
multi-process runs are in tests/test_data_position.py."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from ddp_sigterm._core.epoch_order import EpochPosition, RestOfEpoch, StatefulRestOfEpoch, global_order


def shares(sampler_class: type, samples: int, world: int, **kwargs) -> list[list[int]]:
    """Each rank's own share of an epoch, as its sampler deals it."""
    return [list(sampler_class(range(samples), num_replicas=world, rank=rank, **kwargs)) for rank in range(world)]


@pytest.mark.parametrize("samples", [24, 25, 7])
@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize(("shuffle", "drop_last"), [(True, False), (False, False), (True, True)])
def test_the_global_order_is_what_the_ranks_are_dealt(samples: int, world: int, shuffle: bool, drop_last: bool) -> None:
    for epoch in (0, 3):
        sampler = DistributedSampler(range(samples), num_replicas=world, rank=world - 1, shuffle=shuffle, seed=5,
                                     drop_last=drop_last)
        sampler.set_epoch(epoch)
        order = global_order(sampler)
        own = []
        for rank in range(world):
            dealt = DistributedSampler(range(samples), num_replicas=world, rank=rank, shuffle=shuffle, seed=5,
                                       drop_last=drop_last)
            dealt.set_epoch(epoch)
            own.append(list(dealt))
        assert [order[rank::world] for rank in range(world)] == own
        assert global_order(sampler, lambda place: 100 + place) == [100 + sample for sample in order]


def test_a_stateful_samplers_pending_position_does_not_cut_the_order() -> None:
    sampler = StatefulDistributedSampler(range(20), num_replicas=2, rank=0, seed=1)
    sampler.load_state_dict({"yielded": 6})
    assert global_order(sampler)[0::2] == shares(DistributedSampler, 20, 2, seed=1)[0]


def position(samples: int, world: int, batches: int, batch_size: int = 2, **kwargs) -> EpochPosition:
    sampler = DistributedSampler(range(samples), num_replicas=world, rank=0, seed=3, **kwargs)
    sampler.set_epoch(1)
    order = global_order(sampler)
    consumed = batches * batch_size
    return EpochPosition(1, world, batch_size, consumed, min(world * consumed, len(order)), order)


def test_on_the_same_ranks_the_rest_is_the_stopped_runs_own() -> None:
    stopped = position(25, 3, batches=2)  # 25 samples over 3 ranks: 2 places of padding
    own = [stopped.order[rank::3] for rank in range(3)]
    rest = stopped.rest(3)
    assert [rest[rank::3] for rank in range(3)] == [dealt[stopped.consumed:] for dealt in own]


@pytest.mark.parametrize(("before", "after"), [(3, 2), (2, 3), (4, 1), (1, 4), (3, 5)])
@pytest.mark.parametrize("multiple", [1, 2])
def test_on_other_ranks_each_sample_not_trained_comes_once(before: int, after: int, multiple: int) -> None:
    for samples in (24, 25, 31):
        for batches in range(0, 25 // (before * 2) + 1):
            stopped = position(samples, before, batches)
            trained = set(stopped.order[:stopped.trained])
            rest = stopped.rest(after, multiple)
            left = set(range(samples)) - trained
            assert set(rest) == left
            counts = Counter(rest)
            padding = len(rest) - len(left)
            assert padding == sum(counts.values()) - len(counts) < after * multiple
            assert len(rest) % (after * multiple) == 0


def test_a_stop_in_a_dealt_epoch_continues_from_what_both_runs_trained() -> None:
    """3 ranks stop, 2 resume and stop again, then 3 or 5 finish: each sample of the epoch once over all, padding
    aside."""
    rng = random.Random(0)
    for _ in range(50):
        samples = rng.randint(10, 60)
        first = position(samples, 3, rng.randint(0, samples // 6), batch_size=1)
        rest = first.rest(2)
        dealt = rng.randint(0, len(rest) // 2)  # per rank, on 2 ranks
        second = first.continued(rest, 2, 1, first.consumed + dealt)
        assert second.consumed == first.consumed + dealt
        trained = first.order[:first.trained] + rest[:2 * dealt]
        assert second.order[:second.trained] == trained
        for third in (2, 3, 5):
            final = second.rest(third)
            everything = Counter(trained + final)
            assert set(everything) == set(range(samples))
            # trained twice: only places of padding, the second run's (in rest) or the third's (its own)
            padding = (len(rest) - len(set(rest))) + (0 if third == 2 else len(final) - len(set(final)))
            assert sum(everything.values()) - samples <= padding < 2 + third
        assert second.rest(2) == rest[2 * dealt:]  # the same ranks again: where the dealt epoch stood


def test_a_position_survives_the_checkpoint() -> None:
    stopped = position(25, 3, batches=2)
    saved = stopped.as_dict()
    assert isinstance(saved["order"], torch.Tensor)
    assert EpochPosition.from_dict(saved) == stopped
    with pytest.raises(ValueError, match="trained must be within"):
        EpochPosition(0, 2, 1, 1, 30, [0, 1])


def test_the_rest_of_epoch_passes_over_the_loaders_own_position_then_gives_its_sampler_back() -> None:
    """Through torchdata's StatefulDataLoader, as a resumed fit has it: the position it saved at the stop (3 batches
    of rank 1 of 2), loaded into a new loader, passes over the samples dealt first; then comes this rank's share; at
    the next epoch the loader's own sampler deals again, told the epoch."""
    stopped = position(24, 2, batches=3, batch_size=2)
    before = StatefulDataLoader(range(24), batch_size=2, sampler=DistributedSampler(range(24), 2, 1, seed=3))
    before.sampler.set_epoch(1)
    seen = iter(before)
    for _ in range(3):
        next(seen)
    saved = before.state_dict()
    own = DistributedSampler(range(24), 2, 1, seed=3)
    loader = StatefulDataLoader(range(24), batch_size=2, sampler=own)
    loader.load_state_dict(saved)
    share = [5, 7, 9]  # stand-ins: what the resumed rank is dealt
    dealing = RestOfEpoch(loader.batch_sampler, 1, stopped.order[:stopped.consumed], share, stopped, share)
    loader.batch_sampler.sampler = dealing
    assert len(loader) == 5  # 3 batches passed over, then 5 7 | 9
    assert [batch.tolist() for batch in loader] == [[5, 7], [9]]
    dealing.set_epoch(1)
    assert loader.batch_sampler.sampler is dealing
    assert own.epoch == 1
    dealing.set_epoch(2)
    assert loader.batch_sampler.sampler is own
    assert own.epoch == 2
    assert [sample for batch in loader for sample in batch.tolist()] == list(own)


def test_the_stateful_rest_of_epoch_passes_over_what_its_position_says() -> None:
    own = StatefulDistributedSampler(range(24), num_replicas=2, rank=1, seed=3)
    own.load_state_dict({"yielded": 6})  # what the loader handed it at the resume
    batch_sampler = StatefulDataLoader(range(24), batch_size=2, sampler=own).batch_sampler
    stopped = position(24, 2, batches=3)
    dealing = StatefulRestOfEpoch(batch_sampler, 1, stopped.order[:6], [100, 101], stopped, [100, 101])
    dealing.load_state_dict({"yielded": 6})
    assert list(dealing) == [100, 101]
    assert dealing.state_dict() == {"yielded": 8}
    assert list(dealing) == list(stopped.order[:6]) + [100, 101]  # no position given: the whole epoch
    assert own.state_dict() == {"yielded": 0}
    assert len(list(own)) == 12
    with pytest.raises(ValueError, match="not a StatefulDistributedSampler's"):
        dealing.load_state_dict({"position": 3})
