"""The training data's place in its epoch across a stop, for a resume on the same or another number of ranks:
where Lightning's loader position is not exact (a wrapped sampler, other ranks), the recorded epoch order's rest is
dealt, or the epoch starts over, said once (docs/trainer.md)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.utils.data import DistributedSampler

from ddp_sigterm._core import epoch_order
from ddp_sigterm._core.epoch_order import EpochPosition
from ddp_sigterm._core.log import logger
from ddp_sigterm._lightning import resume_internals
from ddp_sigterm._lightning.internals import EpochLength

KEY = "data_position"  # in the stop checkpoint's own entry (stop_checkpoints.KEY): what :func:`record` returns


@dataclasses.dataclass
class Resumed:
    changed: bool = False  # a loader changed: the fit's iterator must be made again
    said: list[str] = dataclasses.field(default_factory=list)  # what rank 0 says, once
    lengths: EpochLength | None = None  # the fit's own, for after the dealt epoch
    start_over: list[Any] = dataclasses.field(default_factory=list)  # loaders not to be given their positions


def record(trainer: Any) -> dict[str, Any]:
    """The training data's place, or why not (an error too, logged: the save goes on), for a resume to say."""
    loaders = resume_internals.training_loaders(trainer)
    entries = []
    for loader in loaders:
        try:
            entry = _entry(trainer, loader) if len(loaders) == 1 else {"why": f"one of {len(loaders)} loaders"}
        except Exception as error:  # the stop checkpoint matters more than the data's place in it
            logger.warning("ddp_sigterm: the training loader's place in its epoch could not be recorded: %s: %s",
                           type(error).__name__, error, exc_info=error)
            entry = {"why": f"recording it at the stop failed: {type(error).__name__}: {error}"}
        entries.append(entry)
    return {"world_size": trainer.world_size, "batch_size": _global_batch_size(trainer, loaders), "loaders": entries}


def _entry(trainer: Any, loader: Any) -> dict[str, Any]:
    batch_sampler = getattr(loader, "batch_sampler", None)
    if not epoch_order.has_state(loader):
        return {"why": _no_state(loader)}
    own = epoch_order.own_sampler(batch_sampler)
    wrapped = resume_internals.wrapped_sampler(own)
    batch_size = getattr(batch_sampler, "batch_size", None)
    consumed = resume_internals.batches_this_epoch(trainer) * batch_size if isinstance(batch_size, int) else 0
    entry = epoch_order.record(batch_sampler, consumed, None if wrapped is None else own.dataset.__getitem__,
                               resume_internals.is_sampler_wrapper)
    generator = getattr(wrapped, "generator", None)
    return {**entry, "samples": len(loader.dataset),
            "generator": generator.get_state() if isinstance(generator, torch.Generator) else None}


def resume(trainer: Any, recorded: dict[str, Any] | None) -> Resumed:
    """Before the resumed fit's loaders get their positions back: deal the rest of the epoch ``recorded`` where
    those would not give it, or start it over."""
    loaders = resume_internals.training_loaders(trainer)
    resumed = Resumed()
    if recorded is None or not loaders:
        return resumed
    before, now = int(recorded["world_size"]), trainer.world_size
    entries = recorded["loaders"] if len(recorded["loaders"]) == len(loaders) else [None] * len(loaders)
    if before != now:
        resumed.said.append(f"ddp_sigterm: the job resumed on {now} ranks where it stopped on {before}: the global "
                            f"batch size was {recorded['batch_size']}, it is {_global_batch_size(trainer, loaders)}")
    for loader, entry in zip(loaders, entries):
        sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
        known = entry is not None and "position" in entry
        if before == now and not known:
            continue  # as stock Lightning resumes it
        if known and entry["own_order"] and isinstance(sampler, DistributedSampler) \
                and sampler.num_replicas == entry["position"]["world_size"]:
            continue  # the loader's own position gives the rest of the epoch back
        why = _deal_the_rest(trainer, loader, entry, resumed)
        if why is not None:
            resumed.start_over.append(loader)  # not given its position: the epoch's first batch next
            resumed.changed = True
            resumed.said.append(epoch_order.start_over_message(resume_internals.epoch_now(trainer), before, now, why))
    return resumed


def _deal_the_rest(trainer: Any, loader: Any, entry: dict[str, Any] | None, resumed: Resumed) -> str | None:
    """Have ``loader`` deal this rank's share of the rest of the epoch; returns why it cannot, or None."""
    sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    if not epoch_order.has_state(loader):
        return _no_state(loader)
    if entry is None:
        return "the stop recorded no place for it"
    if "position" not in entry:
        return str(entry["why"])
    if not isinstance(sampler, DistributedSampler):
        return f"its sampler, {type(sampler).__name__}, is not distributed"
    if epoch_order.has_state(sampler) and "yielded" not in sampler.state_dict():  # type: ignore[attr-defined]
        return f"its sampler, {type(sampler).__name__}, keeps a position of its own"
    if len(loader.dataset) != entry["samples"]:
        return f"its dataset has {len(loader.dataset)} samples, {entry['samples']} at the stop"
    position = EpochPosition.from_dict(entry["position"])
    if position.epoch != resume_internals.epoch_now(trainer) or position.trained == len(position.order):
        return None  # the stopped epoch was over
    batch_sampler, own_length = loader.batch_sampler, len(loader.batch_sampler)
    # the loader's own restored position passes over as many samples as it had given out at the stop
    dealing = epoch_order.deal(batch_sampler, position, position.consumed)
    batches = len(batch_sampler)
    if batches != own_length:
        if trainer.limit_train_batches != 1.0:
            batch_sampler.sampler = sampler
            return f"limit_train_batches={trainer.limit_train_batches} cuts an epoch of another length"
        resumed.lengths = resume_internals.set_epoch_length(trainer, batches)
    generator = getattr(resume_internals.wrapped_sampler(sampler), "generator", None)
    if entry["generator"] is not None and isinstance(generator, torch.Generator):
        generator.set_state(entry["generator"])  # its next draw is the next epoch's, as in the run that stopped
    resumed.changed = True
    if sampler.num_replicas != position.world_size:
        resumed.said.append(epoch_order.dealt_message(dealing))
    return None


def _no_state(loader: Any) -> str:
    return f"{type(loader).__name__} has no state_dict: torchdata's StatefulDataLoader has"


def _global_batch_size(trainer: Any, loaders: list[Any]) -> int | None:
    """Samples per optimizer step over every data-parallel rank; None where a loader's batch size is not known."""
    batch_samplers = [getattr(loader, "batch_sampler", None) for loader in loaders]
    sizes = [size for size in (getattr(each, "batch_size", None) for each in batch_samplers) if isinstance(size, int)]
    if not sizes or len(sizes) != len(loaders):
        return None
    sampler = epoch_order.own_sampler(batch_samplers[0])
    replicas = sampler.num_replicas if isinstance(sampler, DistributedSampler) else trainer.world_size
    return int(replicas * sum(sizes) * trainer.accumulate_grad_batches)
