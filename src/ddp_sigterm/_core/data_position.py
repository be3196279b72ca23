"""A training loader's place in its epoch across a stop, for a loop of one's own (Fabric, torch.distributed)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from ddp_sigterm._core import epoch_order
from ddp_sigterm._core.epoch_order import EpochPosition
from ddp_sigterm._core.log import logger


class DataPosition:
    """Where ``loader`` stands in its epoch: checkpoint it in the loader's place and iterate through :meth:`epoch`.
    Loaded, the stopped epoch goes on, on any number of ranks; where it cannot, rank 0 says why and it starts over."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self._epoch: int | None = None
        self._batches = 0  # of the epoch being iterated, given out (before a stop and after it)
        self._loaded: dict[str, Any] | None = None  # until the next epoch begins

    def epoch(self, epoch: int) -> Iterator[Any]:
        """The batches of ``epoch`` (its sampler told the epoch first), or of what is left of it after a load."""
        batch_sampler = getattr(self.loader, "batch_sampler", None)
        own = epoch_order.own_sampler(batch_sampler)
        if batch_sampler is not None:
            batch_sampler.sampler = own  # an epoch dealt before is over
        set_epoch = getattr(own, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        self._epoch, self._batches = epoch, 0
        loaded, self._loaded = self._loaded, None
        if loaded is not None:
            self._go_on(loaded, epoch)
        for batch in self.loader:
            self._batches += 1
            yield batch

    def _go_on(self, loaded: dict[str, Any], epoch: int) -> None:
        entry, before = loaded["place"], loaded["world_size"]
        batch_sampler = getattr(self.loader, "batch_sampler", None)
        own = getattr(batch_sampler, "sampler", None)
        now = int(getattr(own, "num_replicas", 0)) or _world_size()
        if before != now:
            _on_rank_0(f"ddp_sigterm: the job resumed on {now} data-parallel ranks where it stopped on {before}: the "
                       f"global batch size was {before * loaded['batch_size']}, it is "
                       f"{now * getattr(batch_sampler, 'batch_size', 0)}")
        stateful = loaded["loader"] is not None
        if "position" not in entry:
            if before != now:
                _on_rank_0(epoch_order.start_over_message(epoch, before, now, str(entry["why"])))
            elif stateful:
                self.loader.load_state_dict(loaded["loader"])  # as the loader alone would resume
            return
        position = EpochPosition.from_dict(entry["position"])
        if position.epoch != epoch:
            return  # saved at the end of an epoch: the next is new
        if not hasattr(own, "num_replicas"):
            why = f"its sampler, {type(own).__name__}, is not distributed now"
            _on_rank_0(epoch_order.start_over_message(epoch, before, now, why))
            return
        self._batches = position.consumed // position.batch_size
        if stateful:  # it passes over what it had given out, of what is dealt below or of its own order
            self.loader.load_state_dict(loaded["loader"])
        if entry["own_order"] and stateful and now == position.world_size:
            return  # the loader's own position gives the rest of the epoch back
        dealing = epoch_order.deal(self.loader.batch_sampler, position, position.consumed if stateful else 0)
        if now != position.world_size:
            _on_rank_0(epoch_order.dealt_message(dealing))

    def state_dict(self) -> dict[str, Any]:
        """The loader's own position, and the epoch's order and how much of it was trained (every rank's alike)."""
        batch_sampler = getattr(self.loader, "batch_sampler", None)
        own = epoch_order.own_sampler(batch_sampler)
        size = getattr(batch_sampler, "batch_size", None)
        if self._epoch is None:
            place: dict[str, Any] = {"why": "no epoch had begun"}
        elif not isinstance(size, int):
            place = {"why": "it has no batch sampler with a batch size (an IterableDataset?)"}
        else:
            place = epoch_order.record(batch_sampler, self._batches * size)
        return {"loader": self.loader.state_dict() if epoch_order.has_state(self.loader) else None, "place": place,
                "world_size": own.num_replicas if hasattr(own, "num_replicas") else _world_size(),
                "batch_size": size if isinstance(size, int) else 0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Keep ``state`` for the next :meth:`epoch`, which goes on from it."""
        if not epoch_order.has_state(self.loader):
            state = {**state, "loader": None}  # saved from a loader with a position, given to one without
        self._loaded = state


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _on_rank_0(message: str) -> None:
    """At WARNING, by global rank 0: the loop may not have started a coordinator (which sets the level)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        logger.warning(message)
