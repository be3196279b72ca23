"""Fabric: a Fabric loop asks the job's coordinator at its own step boundary.

Fabric has no training loop of its own, so the package cannot find the step boundary, and it must not
take SIGTERM away from a script that never asks: installing the package changes nothing in a Fabric
script's signal handling. A loop opts in with one call, after ``fabric.launch()``, on every rank::

    from ddp_sigterm.fabric import save_at_stop, unison_stop

    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)
    stop = unison_stop(fabric)            # every rank, same point: records stop signals from here on
    try:
        for step in range(start, max_steps + 1):
            ...                           # forward, fabric.backward(loss), optimizer.step()
            if stop.should_stop(step):    # same answer on every rank, at the same step
                save_at_stop(fabric, path, state)  # fabric.save, checked on every rank
                raise SystemExit(stop.exit_code)  # 128 + signal: 143 for SIGTERM
        if stop.decide_now(step):         # a signal after the last agreement is not lost
            ...
    finally:
        stop.close()                      # every rank: handlers back, the heartbeat and its groups gone

The entry points (``lightning.fabric.callbacks_factory`` and ``lightning_fabric.callbacks_factory``)
add a :class:`FabricStop` to every Fabric. It holds the settings and the coordinator, and does nothing
else: a Fabric script that never calls :func:`unison_stop` runs exactly as without the package.
"""

from __future__ import annotations

from typing import Any

from torch.nn import Module
from torch.optim import Optimizer

from ddp_sigterm._core import epoch_order
from ddp_sigterm._core.coordinator import StopCoordinator
from ddp_sigterm._core.settings import Settings
from ddp_sigterm._core.stop_save import save_in_unison
from ddp_sigterm._lightning import internals
from ddp_sigterm._lightning.registration import Integration, acting


class FabricStop(Integration):
    """A Fabric callback (any object is one): the settings and the coordinator of one Fabric.

    Pass it to choose settings in code, ``Fabric(callbacks=[FabricStop(max_delay=0.5)])``; the
    instance the entry point added then steps aside. ``DDP_SIGTERM_*`` variables override arguments.
    """

    def __init__(self, settings: Settings | None = None, **overrides: Any) -> None:
        super().__init__(settings, **overrides)
        self.coordinator: StopCoordinator | None = None


def unison_stop(fabric: Any) -> StopCoordinator:
    """The started :class:`StopCoordinator` of ``fabric``'s job. Call it after ``fabric.launch()`` on
    every rank at the same point (starting is a collective); later calls return the same coordinator.

    Settings come from the :class:`FabricStop` passed in ``Fabric(callbacks=...)``, else from the one
    the entry point added, else (package not installed as a distribution) from the environment. With
    ``DDP_SIGTERM=0`` the coordinator is inert: no handlers, ``should_stop`` always False."""
    internals.validate_launched(fabric)
    callbacks = internals.fabric_callbacks(fabric)
    holder = acting(callbacks, FabricStop)
    if holder is None:
        holder = FabricStop()
        callbacks.append(holder)
    if holder.coordinator is None:
        # the agreement's ranks are this Fabric's: a one-device Fabric agrees with no one
        holder.coordinator = StopCoordinator(holder.settings, distributed=fabric.world_size > 1,
                                             on_decided=[internals.retire_child_watch],
                                             notice=holder.notice_settings)
        holder.coordinator.start()
    return holder.coordinator


def save_at_stop(fabric: Any, path: str, state: dict[str, Any]) -> str | None:
    """``fabric.save(path, state)`` at the agreed stop, on every rank, checked: Fabric writes a
    temporary file beside ``path``, every rank learns whether the save worked everywhere, then rank 0
    renames it to ``path`` (:func:`ddp_sigterm.save_in_unison`). A failure anywhere raises
    :class:`ddp_sigterm.StopError` on every rank — including the ``PermissionError`` that Lightning's
    own save (2.6.6) reports as success. Returns ``path`` on rank 0, None elsewhere."""
    return save_in_unison(unison_stop(fabric), lambda partial: fabric.save(partial, state), path,
                          writer=fabric.is_global_zero)


def load(fabric: Any, path: str, state: dict[str, Any]) -> dict[str, Any]:
    """``fabric.load(path, state)``, and every object of ``state`` that has ``load_state_dict`` (a
    :class:`ddp_sigterm.DataPosition`, a ``StatefulDataLoader``, not the model and optimizers) given its saved state:
    Fabric's load of a sharded checkpoint (``ModelParallelStrategy``, ``FSDPStrategy``: Lightning 2.6.6, and master
    in July 2026) puts the saved state in its place instead, so the loop's own object would start afresh. Returns
    what ``fabric.load`` returns: the checkpoint's entries that ``state`` does not name."""
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
