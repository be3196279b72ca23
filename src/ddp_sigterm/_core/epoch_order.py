"""Where a stop left the training data in its epoch, and the rest of that epoch on any number of ranks. A sampler
deals place ``i`` of the epoch's order to rank ``i % W`` and every rank stops at the same batch, so what was trained
is a prefix: :class:`EpochPosition` records both, :class:`RestOfEpoch` deals the rest. Pure: torch only."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DistributedSampler, Sampler


@dataclasses.dataclass(frozen=True)
class EpochPosition:
    """A training loader's place in its epoch at a stop, the same on every rank."""

    epoch: int
    world_size: int  # the ranks the epoch was dealt to
    batch_size: int
    consumed: int  # samples each rank's loader has given out in the epoch
    trained: int  # places of ``order`` trained, a prefix (``world_size × consumed`` unless resumed on other ranks)
    order: list[int]  # the epoch's global order: the sample at place ``i`` went to rank ``i % world_size``

    def __post_init__(self) -> None:
        if not 0 <= self.trained <= len(self.order):
            raise ValueError(f"trained must be within the epoch's {len(self.order)} places, got {self.trained}")
        if self.world_size < 1 or self.batch_size < 1 or self.consumed < 0:
            raise ValueError(f"not a position: world_size {self.world_size}, batch_size {self.batch_size}, "
                             f"consumed {self.consumed}")

    def rest(self, world_size: int, multiple: int = 1) -> list[int]:
        """The rest's global order on ``world_size`` ranks: on another number, each sample not trained yet, once,
        padded as DistributedSampler pads, to a multiple of ``world_size × multiple`` (a batch, with drop_last)."""
        if world_size == self.world_size:
            return self.order[self.trained:]
        trained = set(self.order[:self.trained])
        rest = [sample for sample in dict.fromkeys(self.order[self.trained:]) if sample not in trained]
        if not rest:
            return rest
        short = -len(rest) % (world_size * multiple)
        return rest + (rest * (short // len(rest) + 1))[:short]

    def continued(self, rest: list[int], world_size: int, batch_size: int, consumed: int) -> EpochPosition:
        """The position once the epoch went on as ``rest`` on ``world_size`` ranks, each having given out
        ``consumed`` samples in all."""
        per_rank = consumed - self.consumed
        return EpochPosition(self.epoch, world_size, batch_size, consumed, self.trained + world_size * per_rank,
                             self.order[:self.trained] + rest)

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "order": torch.tensor(self.order, dtype=torch.int64)}

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> EpochPosition:
        order = saved["order"]
        return cls(**{**saved, "order": order.tolist() if isinstance(order, torch.Tensor) else list(order)})


def global_order(sampler: DistributedSampler[Any], place: Callable[[int], int] | None = None) -> list[int]:
    """The order ``sampler`` deals for its epoch, by torch's iteration for one rank; ``place`` maps a place to a
    sample (Lightning's DistributedSamplerWrapper)."""
    whole = copy.copy(sampler)
    whole.num_replicas, whole.rank, whole.num_samples = 1, 0, sampler.total_size
    places = list(DistributedSampler.__iter__(whole))
    return places if place is None else [place(index) for index in places]


def deals_global_order(sampler: DistributedSampler[Any], known: Callable[[type], bool] | None = None) -> bool:
    """Whether ``sampler``'s iteration is torch's DistributedSampler's, torchdata's StatefulDistributedSampler's, or
    one ``known(cls)`` vouches for (a subclass's own is not)."""
    owner = next(cls for cls in type(sampler).__mro__ if "__iter__" in vars(cls))
    return owner is DistributedSampler or owner.__module__.startswith("torchdata.stateful_dataloader") or \
        (known is not None and known(owner))


def record(batch_sampler: Any, consumed: int, place: Callable[[int], int] | None = None,
           known: Callable[[type], bool] | None = None) -> dict[str, Any]:
    """A loader's place in its epoch, each rank having trained ``consumed`` samples: ``{"position", "own_order"}``
    (``own_order``: its own sampler deals the same order again on as many ranks), or ``{"why"}``."""
    batch_size = getattr(batch_sampler, "batch_size", None)
    dealing = getattr(batch_sampler, "sampler", None)
    dealing = dealing if isinstance(dealing, RestOfEpoch) else None  # a stop again, in the rest of an epoch dealt here
    sampler = own_sampler(batch_sampler)
    if not isinstance(batch_size, int):
        return {"why": "its batch sampler has no batch size"}
    if not isinstance(sampler, DistributedSampler):
        return {"why": f"its sampler, {type(sampler).__name__}, is not distributed"}
    if not deals_global_order(sampler, known):
        return {"why": f"its sampler, {type(sampler).__name__}, deals an order of its own"}
    if dealing is not None:
        position = dealing.position.continued(dealing.rest, sampler.num_replicas, batch_size, consumed)
    else:
        order = global_order(sampler, place)
        position = EpochPosition(sampler.epoch, sampler.num_replicas, batch_size, consumed,
                                 min(sampler.num_replicas * consumed, len(order)), order)
    return {"position": position.as_dict(), "own_order": place is None and dealing is None}


def has_state(thing: Any) -> bool:
    """Whether ``thing`` keeps a position of its own (``state_dict`` and ``load_state_dict``, as torchdata's)."""
    return all(callable(getattr(thing, name, None)) for name in ("state_dict", "load_state_dict"))


def own_sampler(batch_sampler: Any) -> Any:
    """The sampler of ``batch_sampler``, under a :class:`RestOfEpoch` that stands in for it."""
    sampler = getattr(batch_sampler, "sampler", None)
    return sampler.sampler if isinstance(sampler, RestOfEpoch) else sampler


def deal(batch_sampler: Any, position: EpochPosition, skipped: int) -> RestOfEpoch:
    """Have ``batch_sampler`` deal this rank's share of the rest of the epoch, after the ``skipped`` samples that
    the loader's restored position passes over."""
    own = batch_sampler.sampler
    world, rank = own.num_replicas, own.rank
    rest = position.rest(world, batch_sampler.batch_size if getattr(batch_sampler, "drop_last", False) else 1)
    kind = StatefulRestOfEpoch if has_state(own) else RestOfEpoch
    dealing = kind(batch_sampler, position.epoch, position.order[:skipped], rest[rank::world], position, rest)
    batch_sampler.sampler = dealing
    return dealing


def start_over_message(epoch: int, before: int, now: int, why: str) -> str:
    return (f"ddp_sigterm: the training loader's place in epoch {epoch} cannot be carried from {before} ranks to "
            f"{now} ({why}): the epoch starts over")


def dealt_message(dealing: RestOfEpoch) -> str:
    rest, size = dealing.rest, dealing.batch_sampler.batch_size
    left, share = len(set(rest)), len(dealing.indices) - dealing.skipped
    return (f"ddp_sigterm: the rest of epoch {dealing.epoch}, {left} samples not trained yet, is dealt out over the "
            f"{dealing.sampler.num_replicas} data-parallel ranks, each sample once ({len(rest) - left} places of "
            f"padding): {-(-share // size)} batches each")


class RestOfEpoch(Sampler[int]):
    """A loader's sampler for the rest of one epoch: ``skipped`` samples, then this rank's share; the next epoch's
    ``set_epoch`` puts the own one back."""

    def __init__(self, batch_sampler: Any, epoch: int, skipped: list[int], share: list[int],
                 position: EpochPosition, rest: list[int]) -> None:
        self.batch_sampler, self.sampler = batch_sampler, batch_sampler.sampler
        self.epoch, self.indices, self.skipped = epoch, skipped + share, len(skipped)
        self.position, self.rest = position, rest

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)

    def set_epoch(self, epoch: int) -> None:
        """Passed on to the loader's own sampler (Lightning may reach it only here), which deals from the next epoch."""
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        if epoch != self.epoch and self.batch_sampler.sampler is self:
            self.batch_sampler.sampler = self.sampler


class StatefulRestOfEpoch(RestOfEpoch):
    """:class:`RestOfEpoch` for a sampler with a position of its own (torchdata's ``{"yielded": n}``), which a
    loader passes over by asking it, not by drawing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._from, self.yielded = 0, 0
        # the loader gave its own sampler the stop's position already (its iteration takes it up only when it starts
        # drawing): this epoch's rest is dealt here, and the next epoch starts at its beginning
        self.sampler.load_state_dict({"yielded": 0})

    def __iter__(self) -> Iterator[int]:
        start, self._from = self._from, 0
        self.yielded = start
        for sample in self.indices[start:]:
            self.yielded += 1
            yield sample

    def state_dict(self) -> dict[str, int]:
        return {"yielded": self.yielded}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "yielded" not in state:
            raise ValueError(f"ddp_sigterm: the loader's sampler position {sorted(state)} is not a "
                             "StatefulDistributedSampler's ('yielded'): the rest of the epoch cannot pass over it")
        self._from = int(state["yielded"])
