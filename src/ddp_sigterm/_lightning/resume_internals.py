"""The accessors of Lightning's private names that a stop's record and a resume reach (the training loaders, the
sampler wrapper, the loggers' runs); the names are listed, with the rest, in :mod:`internals`."""

from __future__ import annotations

import csv
import io
import sys
import warnings
from collections.abc import Iterable
from typing import Any

from fsspec.core import url_to_fs

from ddp_sigterm._core import epoch_order
from ddp_sigterm._lightning.internals import LOGGERS, SAMPLER_WRAPPER

_LIGHTNING_PACKAGES = ("lightning.", "pytorch_lightning.", "lightning_fabric.")
_RUN_NAMES = {"TensorBoardLogger": "_version", "CSVLogger": "_version", "WandbLogger": "_id", "MLFlowLogger": "_run_id"}
EpochLength = tuple[int | float, list[int | float] | None]
"""The fit loop's number of batches in an epoch, and its loaders' own limits."""


def saved_loader_positions(checkpoint: dict[str, Any]) -> list[dict[str, Any]]:
    """The positions the fit loop saved in ``checkpoint``, one per stateful training loader, in their order."""
    return list(checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {}).get("combined_loader", []))


def training_loaders(trainer: Any) -> list[Any]:
    """The fit's training loaders, once its data is set up; else empty."""
    loaders = trainer.fit_loop._combined_loader
    return [] if loaders is None else list(loaders.flattened)


def epoch_now(trainer: Any) -> int:
    return int(trainer.fit_loop.epoch_progress.current.processed)


def batches_this_epoch(trainer: Any) -> int:
    """The training batches of this epoch run to their end (at a batch end, that one included)."""
    return int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)


def set_epoch_length(trainer: Any, batches: int | float, limits: list[int | float] | None = None) -> EpochLength:
    """Make the fit's current epoch ``batches`` long (``limits``: the loaders' own, default ``batches`` each), which
    Lightning reads once, at the loaders' set-up; returns what it replaced."""
    fit_loop = trainer.fit_loop
    loaders = fit_loop._combined_loader
    before = fit_loop.max_batches, None if loaders is None else loaders.limits
    fit_loop.max_batches = batches
    if loaders is not None:
        loaders.limits = limits if limits is not None else [batches] * len(loaders.flattened)
    return before


def is_sampler_wrapper(cls: type) -> bool:
    return cls.__name__ == SAMPLER_WRAPPER and cls.__module__.startswith(_LIGHTNING_PACKAGES)


def wrapped_sampler(sampler: Any) -> Any | None:
    """The sampler that Lightning's DistributedSamplerWrapper ``sampler`` wraps; None for any other sampler."""
    return sampler.dataset._sampler if any(is_sampler_wrapper(cls) for cls in type(sampler).__mro__) else None


def restore_loader_positions(trainer: Any, positions: list[dict[str, Any]], start_over: Iterable[Any] = ()) -> bool:
    """At the start of a resumed fit, set the samplers' epoch, then give the training loaders (but ``start_over``)
    their saved ``positions``, which Lightning gives back before the epoch is set or drops (#20550); the iterator
    must then be made again (:func:`remake_iterator`). True if it gave any back."""
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


# -- the loggers' runs --------------------------------------------------------------------------------
def logger_kind(logger: Any) -> str | None:
    """The name of the class of :data:`LOGGERS` that ``logger`` is (or subclasses), None for any other logger."""
    for cls in type(logger).__mro__:
        if cls.__name__ in LOGGERS and cls.__module__.startswith(_LIGHTNING_PACKAGES):
            return cls.__name__
    return None


def logger_run(logger: Any, kind: str) -> Any:
    """The run ``logger`` writes to, if it is fixed already (TensorBoard's and CSV's version, W&B's and MLflow's
    run id); None if the logger chooses it later, when it first needs it."""
    if kind == "WandbLogger":
        if logger._experiment is not None:
            return logger._experiment.id
        active = getattr(sys.modules.get("wandb"), "run", None)  # a run the script made: the logger will take it
        if active is not None:
            return active.id
    return getattr(logger, _RUN_NAMES[kind])


def logger_made(logger: Any, kind: str) -> bool:
    """Whether ``logger`` has made its run (its writer, its W&B run, its MLflow run) already."""
    return bool(logger._initialized) if kind == "MLFlowLogger" else logger._experiment is not None


def give_logger_run(logger: Any, kind: str, run: Any) -> None:
    """Make ``logger``, whose run is not fixed yet, write to ``run``. A CSV logger makes its writer now and keeps
    the ``metrics.csv`` that Lightning's writer deletes in a folder it finds not empty, to append to it."""
    setattr(logger, _RUN_NAMES[kind], run)
    if kind == "WandbLogger":
        logger._wandb_init.update(id=run, resume="allow")
    if kind == "CSVLogger":
        _continue_csv(logger)


def _continue_csv(logger: Any) -> None:
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
