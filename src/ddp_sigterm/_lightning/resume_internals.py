"""The accessors of the private names of Lightning that a stop's record and a resume reach: the training loaders'
positions, the sampler wrapper and the loggers' runs. Their names are listed in :mod:`internals`, which the callback
and the canary check.
"""

from __future__ import annotations

import csv
import io
import sys
import warnings
from collections.abc import Iterable
from typing import Any

from fsspec.core import url_to_fs

from ddp_sigterm._core import epoch_order
from ddp_sigterm._lightning.internals import LIGHTNING_PACKAGES, LOGGERS, RUN_NAMES, SAMPLER_WRAPPER, EpochLength


# -- the training loaders ----------------------------------------------------------------------------
def saved_loader_positions(checkpoint: dict[str, Any]) -> list[dict[str, Any]]:
    """The positions the fit loop saved in ``checkpoint``, one per stateful training loader, in their order."""
    return list(checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {}).get("combined_loader", []))


def training_loaders(trainer: Any) -> list[Any]:
    loaders = trainer.fit_loop._combined_loader
    return [] if loaders is None else list(loaders.flattened)


def epoch_now(trainer: Any) -> int:
    return int(trainer.fit_loop.epoch_progress.current.processed)


def batches_this_epoch(trainer: Any) -> int:
    """At a batch end, that one included."""
    return int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)


def set_epoch_length(trainer: Any, batches: int | float, limits: list[int | float] | None = None) -> EpochLength:
    """Make the fit's current epoch ``batches`` long (each loader's limit: ``limits``); returns what it replaced."""
    fit_loop = trainer.fit_loop
    loaders = fit_loop._combined_loader
    before = fit_loop.max_batches, None if loaders is None else loaders.limits
    fit_loop.max_batches = batches
    if loaders is not None:
        loaders.limits = limits if limits is not None else [batches] * len(loaders.flattened)
    return before


def is_sampler_wrapper(cls: type) -> bool:
    return cls.__name__ == SAMPLER_WRAPPER and cls.__module__.startswith(LIGHTNING_PACKAGES)


def wrapped_sampler(sampler: Any) -> Any | None:
    """The sampler that a DistributedSamplerWrapper ``sampler`` wraps; None for any other sampler."""
    return sampler.dataset._sampler if any(is_sampler_wrapper(cls) for cls in type(sampler).__mro__) else None


def restore_loader_positions(trainer: Any, positions: list[dict[str, Any]], start_over: Iterable[Any]) -> bool:
    """Set the samplers' epoch, then give the loaders (but ``start_over``) their ``positions``, which Lightning gives
    back too early or drops (#20550); True if it gave any (then :func:`remake_iterator`)."""
    fit_loop = trainer.fit_loop
    loaders = training_loaders(trainer)
    stateful = [loader for loader in loaders if epoch_order.has_state(loader)]  # those the fit loop saved, in order
    if not positions or fit_loop._data_fetcher is None or len(stateful) != len(positions):
        return False  # (other loaders than those saved: Lightning raises on its own path)
    epoch = epoch_now(trainer)
    for loader in loaders:
        samplers = (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None))
        for set_epoch in {id(sampler): getattr(sampler, "set_epoch", None) for sampler in samplers}.values():
            if callable(set_epoch):
                set_epoch(epoch)
    fresh = {id(loader) for loader in start_over}
    given = [(loader, position) for loader, position in zip(stateful, positions) if id(loader) not in fresh]
    for loader, position in given:
        loader.load_state_dict(position)
    fit_loop._combined_loader_states_to_load = []  # given back here, where Lightning dropped them (#20550)
    return bool(given)


def remake_iterator(trainer: Any) -> None:
    fetcher = trainer.fit_loop._data_fetcher
    if fetcher is not None:
        iter(fetcher)


# -- the loggers' runs ------------------------------------------------------------------------------
def logger_kind(logger: Any) -> str | None:
    """The name of the class of :data:`LOGGERS` that ``logger`` is (or subclasses), None for any other logger."""
    lightnings = (cls.__name__ for cls in type(logger).__mro__ if cls.__module__.startswith(LIGHTNING_PACKAGES))
    return next((name for name in lightnings if name in LOGGERS), None)


def logger_run(logger: Any, kind: str) -> Any:
    """The run (version, or run id) ``logger`` writes to, if fixed already; None if it chooses one later."""
    if kind == "WandbLogger":
        if logger._experiment is not None:
            return logger._experiment.id
        active = getattr(sys.modules.get("wandb"), "run", None)  # a run the script made: the logger will take it
        if active is not None:
            return active.id
    return getattr(logger, RUN_NAMES[kind])


def logger_made(logger: Any, kind: str) -> bool:
    """Whether ``logger`` has made its run (its writer, its W&B or MLflow run) already."""
    return bool(logger._initialized) if kind == "MLFlowLogger" else logger._experiment is not None


def give_logger_run(logger: Any, kind: str, run: Any) -> None:
    setattr(logger, RUN_NAMES[kind], run)
    if kind == "WandbLogger":
        logger._wandb_init.update(id=run, resume="allow")
    if kind == "CSVLogger":
        _continue_csv(logger)


def _continue_csv(logger: Any) -> None:
    """Make the CSV logger's writer now, keeping the ``metrics.csv`` Lightning's deletes in a folder not empty."""
    fs, folder = url_to_fs(str(logger.log_dir))
    path = f"{folder.rstrip('/')}/metrics.csv"
    kept = fs.cat_file(path) if fs.isfile(path) else None
    with warnings.catch_warnings():  # "... Previous log files in this directory will be deleted ...": not this one
        warnings.filterwarnings("ignore", message=".*Previous log files in this directory will be deleted")
        writer = logger.experiment  # (called on global rank 0 only: elsewhere a placeholder would come back)
    if kept is not None and not fs.isfile(path):
        fs.pipe_file(path, kept)
        header = next(csv.reader(io.StringIO(kept.decode())), [])
        writer.metrics_keys = header  # as if it had written them: it appends to the file, or rewrites it for a new key
