"""Fabric: a loop opts in with :func:`unison_stop` after ``fabric.launch()`` and asks at its own step boundaries (a
script that never asks keeps its own SIGTERM handling). The entry points add a :class:`FabricStop`, which holds the
settings and the coordinator, to every Fabric. docs/fabric.md shows the loop.
"""

from __future__ import annotations

from typing import Any

from torch.nn import Module
from torch.optim import Optimizer

from ddp_sigterm._core import epoch_order
from ddp_sigterm._core.coordinator import StopCoordinator
from ddp_sigterm._core.stop_save import save_in_unison
from ddp_sigterm._lightning import internals
from ddp_sigterm._lightning.registration import Integration, acting


class FabricStop(Integration):
    """A Fabric callback holding one Fabric's settings and coordinator. ``Fabric(callbacks=[FabricStop(...)])``
    chooses settings in code (the entry point's instance then steps aside); ``DDP_SIGTERM_*`` variables win."""

    coordinator: StopCoordinator | None = None  # made by the first unison_stop()


def unison_stop(fabric: Any) -> StopCoordinator:
    """The started :class:`StopCoordinator` of ``fabric``'s job: call it after ``fabric.launch()``, on every rank at
    the same point (a collective); later calls return the same one. Settings: the acting :class:`FabricStop`'s."""
    internals.validate_launched(fabric)
    callbacks = internals.fabric_callbacks(fabric)
    holder = acting(callbacks, FabricStop)
    if holder is None:
        holder = FabricStop()
        callbacks.append(holder)
    if holder.coordinator is None:
        holder.coordinator = StopCoordinator(holder.settings, distributed=fabric.world_size > 1,
                                             on_decided=[internals.retire_child_watch],
                                             notice=holder.notice_settings)
        holder.coordinator.start()
    return holder.coordinator


def save_at_stop(fabric: Any, path: str, state: dict[str, Any]) -> str | None:
    """``fabric.save(path, state)`` at the agreed stop, on every rank, checked (:func:`ddp_sigterm.save_in_unison`):
    a failure anywhere raises :class:`ddp_sigterm.StopError` on every rank. Returns ``path`` on rank 0, else None."""
    return save_in_unison(unison_stop(fabric), lambda partial: fabric.save(partial, state), path,
                          writer=fabric.is_global_zero)


def load(fabric: Any, path: str, state: dict[str, Any]) -> dict[str, Any]:
    """``fabric.load(path, state)``, and each stateful object of ``state`` (not the model and optimizers) given its
    saved state, which Fabric's load of a sharded checkpoint puts in the object's place instead."""
    stateful = {key: value for key, value in state.items()
                if not isinstance(value, (Module, Optimizer)) and epoch_order.has_state(value)}
    rest: dict[str, Any] = fabric.load(path, state)
    for key, value in stateful.items():
        if state.get(key) is not value and isinstance(state.get(key), dict):  # replaced by its saved state
            value.load_state_dict(state[key])
            state[key] = value
    return rest


def callbacks_factory() -> list[Any]:
    """Entry point for ``lightning.fabric.callbacks_factory`` and ``lightning_fabric.callbacks_factory``."""
    return FabricStop.entry_point()
