"""Which samplers' order the stop can record (ddp_sigterm._core.epoch_order, with Lightning's wrapper vouched for by
ddp_sigterm._lightning.internals), without processes. The stop and resume themselves are
tests/test_data_position.py's."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader.sampler import RandomSampler, StatefulDistributedSampler

from ddp_sigterm._core import epoch_order
from ddp_sigterm._lightning import resume_internals


class Bucketing(DistributedSampler):
    """A sampler of the user's that deals an order of its own."""

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(super().__iter__()))


class Plain(DistributedSampler):
    """A subclass that keeps torch's order."""


@pytest.mark.parametrize(("sampler", "known"), [
    (DistributedSampler(range(8), num_replicas=2, rank=0), True),
    (Plain(range(8), num_replicas=2, rank=0), True),
    (StatefulDistributedSampler(range(8), num_replicas=2, rank=0), True),
    (DistributedSamplerWrapper(RandomSampler(range(8)), num_replicas=2, rank=0), True),
    (Bucketing(range(8), num_replicas=2, rank=0), False)], ids=lambda value: type(value).__name__)
def test_the_order_is_known_where_the_sampler_deals_torchs(sampler: DistributedSampler, known: bool) -> None:
    assert epoch_order.deals_global_order(sampler, resume_internals.is_sampler_wrapper) is known
