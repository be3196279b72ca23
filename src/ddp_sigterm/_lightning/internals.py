"""Every private name of Lightning that the package reaches, in one place, checked.

Setting an attribute never fails: if Lightning renamed one of the names below, assigning the old name
would switch part of the fix off without a word. So the integrations reach Lightning's internals only
through the functions of this module; :data:`TRAINER`, :data:`FABRIC` and :data:`LAUNCHER` list each
name with the releases it was checked against; the Trainer callback calls :func:`missing` before it
changes anything and, if a name is gone, warns naming it and leaves the Trainer as stock Lightning runs
it; ``tests/test_internals.py`` (the canary, run on every release of ``make test-versions``) fails
naming it. Behaviour that depends on the release is gated on its version (:func:`at_least`), never on
``hasattr``.

(torch's private names stay with the code that needs them, listed in ``_core/runtime.py``'s ``TORCH_INTERNALS``,
which must not import Lightning; the canary checks them too.)
"""

from __future__ import annotations

import csv
import dataclasses
import importlib
import io
import operator
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Iterable
from types import FrameType, ModuleType
from typing import Any

from fsspec.core import url_to_fs
from lightning_utilities.core.imports import compare_version
from packaging.version import Version

from ddp_sigterm._core import epoch_order

CHECKED = ("2.5.1", "2.5.2", "2.5.6", "2.6.0", "2.6.6")
"""The releases of ``lightning`` and ``pytorch_lightning`` the names were checked against and the
scenarios run on (``make test-versions``). Releases in between have the same names."""

Handler = Callable[[int, Any], Any]


@dataclasses.dataclass(frozen=True)
class Internal:
    """A private name, as a dotted path from the object the integration holds (a Trainer, a Fabric,
    a launcher's thread class), present in every checked release from ``since`` on."""

    path: str
    why: str
    since: str = CHECKED[0]


TRAINER = (
    Internal("_accelerator_connector.cluster_environment", "the SLURM environment and its requeue signal"),
    Internal("_signal_connector._sigterm_notifier_fn", "replaced by the recorder (2.5.2+ broadcasts in the handler)"),
    Internal("_signal_connector._slurm_sigusr_handler_fn", "replaced by the recorder (it saves and requeues in "
             "the handler)"),
    Internal("_signal_connector._sigterm_handler_fn", "replaced (under SLURM it logs from inside the handler)"),
    Internal("_signal_connector._original_handlers", "the handlers Lightning restores at teardown: SIG_IGN after "
             "a stop"),
    Internal("_signal_connector.received_sigterm", "set at the agreed stop, as Lightning's handler would"),
    Internal("_checkpoint_connector.hpc_save_path", "the stop checkpoint's name, hpc_ckpt_<N>.ckpt"),
    Internal("_checkpoint_connector.dump_checkpoint", "the stop checkpoint's contents"),
    Internal("_checkpoint_connector.resume_start", "a fit started without ckpt_path resumes (TrainerSettings.resume)"),
    Internal("_teardown", "Lightning's last step for an exception: ddp_spawn's launching process exits after it"),
    Internal("fit_loop.epoch_loop._should_accumulate", "a stop waits for the optimizer step"),
    Internal("fit_loop.epoch_loop._broadcast_sigterm_tensor", "rank 0's per-batch broadcast, switched off", "2.5.2"),
    Internal("fit_loop._combined_loader", "the training loaders, whose saved positions a resume gives back"),
    Internal("fit_loop._combined_loader_states_to_load", "the positions Lightning left pending (#20550)"),
    Internal("fit_loop._data_fetcher", "its iterator, made again from the positions"),
    Internal("fit_loop.epoch_progress", "the epoch a fit resumes in"),
    Internal("fit_loop.epoch_loop.batch_progress", "the batches of the epoch trained at the stop"),
    Internal("fit_loop.max_batches", "the length of the rest of an epoch resumed on another number of ranks"),
)
BEFORE_RUN = (Internal("_checkpoint_connector._select_ckpt_path", "Lightning's choice of the checkpoint a fit resumes "
                        "from, followed by the loggers' runs given back, before they are made"),)
FABRIC = (
    Internal("_validate_launched", "Fabric's own error when unison_stop() comes before launch()"),
    Internal("_callbacks", "the FabricStop that holds the job's coordinator"),
)
LOGGERS = {
    "TensorBoardLogger": (Internal("_version", "its version, given back before it is resolved"),
                          Internal("_experiment", "its writer, once made")),
    "CSVLogger": (Internal("_version", "its version, given back before it is resolved"),
                  Internal("_experiment", "its writer, made at once where it would delete the run's metrics.csv")),
    "WandbLogger": (Internal("_id", "the W&B run's id, given back before wandb.init"),
                    Internal("_wandb_init", "wandb.init's arguments: the id and resume='allow'"),
                    Internal("_experiment", "its run, once wandb.init has made it")),
    "MLFlowLogger": (Internal("_run_id", "the MLflow run's id, given back before the run is made"),
                     Internal("_initialized", "whether its run is made")),
}
"""The loggers whose run a resume from a stop continues (both distributions' and Fabric's classes of these names, and
their subclasses), and what of each it reaches."""
SAMPLER_WRAPPER = "DistributedSamplerWrapper"
"""The class of Lightning's sampler around a training loader's own non-distributed sampler: it deals out places of
the order its ``dataset`` (a ``_DatasetSamplerWrapper``) draws from that sampler at every iteration."""
WRAPPED = (Internal("dataset._sampler", "the sampler it wraps, whose generator a resume gives back"),)
CHILD_WATCH = "_ChildProcessObserver"
"""The class of the thread by which Lightning's own launcher SIGKILLs every rank once one has exited non-zero."""
LAUNCHER = (
    Internal(f"{CHILD_WATCH}._run", "the child-process watch of Lightning's launcher, retired at the agreed stop"),
)

_TRAINER_HANDLERS = ("_sigterm_notifier_fn", "_slurm_sigusr_handler_fn", "_sigterm_handler_fn")


def launchers(fabric: str) -> ModuleType | None:
    """The module of ``fabric``'s (``lightning.fabric`` or ``lightning_fabric``) launcher watch, None if it is gone."""
    try:
        return importlib.import_module(f"{fabric}.strategies.launchers.subprocess_script")
    except ImportError:
        return None


def at_least(distribution: str, version: str) -> bool:
    """Whether the installed ``distribution`` (``lightning`` or ``pytorch_lightning``) is ``version`` or later."""
    return bool(compare_version(distribution, operator.ge, version))


def missing(owner: Any, internals: Iterable[Internal], distribution: str) -> list[str]:
    """The paths of ``internals`` that ``owner`` lacks, among those its release should have."""
    gone = []
    if owner is None:
        return [f"{internal.path} ({internal.why})" for internal in internals]
    for internal in internals:
        if not at_least(distribution, internal.since):
            continue
        found = owner
        for name in internal.path.split("."):
            if not hasattr(found, name):
                gone.append(f"{internal.path} ({internal.why})")
                break
            found = getattr(found, name)
    return gone


def untested(distribution: str, version: str) -> str | None:
    """A warning for a release outside the checked range, else None."""
    release = Version(version).release
    if Version(CHECKED[0]).release <= release <= Version(CHECKED[-1]).release:
        return None
    return (f"ddp_sigterm was tested with {distribution} {CHECKED[0]} to {CHECKED[-1]} ({', '.join(CHECKED)}); this is "
            f"{distribution} {version}: the Lightning internals it needs are present, but the stop is untested here")


def warn_once(message: str) -> None:
    """One warning per message and process (the Trainer callback runs at every Trainer's set-up)."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)


_warned: set[str] = set()


# -- the Trainer -------------------------------------------------------------------------------------
def requeue_signal(trainer: Any, slurm_environment: type[Any]) -> int | None:
    """SLURM's requeue signal if the Trainer runs under SLURM with auto-requeue on, else None."""
    environment = trainer._accelerator_connector.cluster_environment
    if isinstance(environment, slurm_environment) and environment.auto_requeue:
        return int(environment.requeue_signal)
    return None


def routed_signals(requeue: int | None) -> tuple[int, ...]:
    """The signals :func:`take_signal_handlers` hands the recorder: SIGTERM, and SLURM's requeue signal."""
    return (signal.SIGTERM,) + (() if requeue is None else (requeue,))


def take_signal_handlers(trainer: Any, record: Handler, distribution: str) -> None:
    """Route the Trainer's SIGTERM and SLURM requeue signal to ``record``; Lightning still registers,
    chains and restores the handlers. Switch off rank 0's per-batch broadcast (2.5.2+)."""
    connector = trainer._signal_connector
    connector._sigterm_notifier_fn = record
    connector._slurm_sigusr_handler_fn = record
    connector._sigterm_handler_fn = _ignore  # under SLURM it only logs, from inside the handler
    if at_least(distribution, "2.5.2"):
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = _no_broadcast


def restore_trainer(trainer: Any) -> None:
    """Undo :func:`take_signal_handlers` and :func:`resume_when_not_told` (the instance attributes
    shadow the class's methods)."""
    for name in _TRAINER_HANDLERS:
        trainer._signal_connector.__dict__.pop(name, None)
    trainer.fit_loop.epoch_loop.__dict__.pop("_broadcast_sigterm_tensor", None)
    trainer._checkpoint_connector.__dict__.pop("resume_start", None)


def resume_when_not_told(trainer: Any, choose: Callable[[], str | None]) -> None:
    """Make a ``fit`` started without ``ckpt_path`` (after Lightning's own choice, e.g. SLURM's
    ``hpc``, found nothing) load ``choose()``'s checkpoint, if it names one. Every rank calls
    ``choose`` at the same point (the restore of ``fit``); :func:`restore_trainer` undoes it."""
    connector = trainer._checkpoint_connector
    lightnings = type(connector).resume_start.__get__(connector)

    def resume_start(checkpoint_path: Any = None, *args: Any, **kwargs: Any) -> Any:
        if checkpoint_path is None and trainer.state.fn == "fit":
            checkpoint_path = choose()
        return lightnings(checkpoint_path, *args, **kwargs)

    connector.resume_start = resume_start


def trainer_being_made(trainer_class: type[Any]) -> Any | None:
    """The ``trainer_class`` whose ``__init__`` is running in this thread (Lightning calls the
    ``callbacks_factory`` entry point from there), or None. The one Trainer the package finds by looking at the
    callers' frames: a callback gets no Trainer before its ``setup``."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        found = frame.f_locals.get("self") if frame.f_code.co_name == "__init__" else None
        if isinstance(found, trainer_class):
            return found
        frame = frame.f_back
    return None


class CheckpointChoice:
    """Takes the place of a Trainer's ``_checkpoint_connector._select_ckpt_path``, for the Trainer's life: Lightning
    chooses the checkpoint a ``fit`` (``validate``, ...) restores, then ``then(trainer, stage, path)`` runs, before
    ``Trainer._run`` makes the loggers' runs; the path is returned unchanged. A module-level class and function, so
    that ``ddp_spawn`` can pickle the Trainer."""

    def __init__(self, connector: Any, then: Callable[[Any, str, Any], None]) -> None:
        self.connector, self.then = connector, then

    def __call__(self, state_fn: Any, ckpt_path: Any, *args: Any, **kwargs: Any) -> Any:
        path = type(self.connector)._select_ckpt_path(self.connector, state_fn, ckpt_path, *args, **kwargs)
        self.then(self.connector.trainer, str(getattr(state_fn, "value", state_fn)), path)
        return path


def before_run(trainer: Any, then: Callable[[Any, str, Any], None]) -> None:
    """Make ``then`` run at every choice of ``trainer``'s checkpoint (see :class:`CheckpointChoice`), once."""
    connector = trainer._checkpoint_connector
    if not isinstance(connector.__dict__.get("_select_ckpt_path"), CheckpointChoice):
        connector._select_ckpt_path = CheckpointChoice(connector, then)


def mark_stopped(trainer: Any, ignore: Iterable[int]) -> None:
    """At the agreed stop: Lightning's flag, as its own handler would set it, and the handlers it puts
    back at teardown become SIG_IGN for ``ignore`` (as :meth:`ddp_sigterm._core.runtime.Runtime.close` ignores them)."""
    originals = trainer._signal_connector._original_handlers
    for signum in ignore:
        if signum in originals:
            originals[signum] = signal.SIG_IGN
    trainer._signal_connector.received_sigterm = True


def raise_after_teardown(trainer: Any, ending: BaseException) -> None:
    """Make the Trainer's teardown for the exception on its way out (the last thing Lightning does before
    re-raising it) raise ``ending`` instead, once Lightning's teardown has run."""
    lightnings = type(trainer)._teardown.__get__(trainer)

    def _teardown() -> None:
        del trainer._teardown
        lightnings()
        trainer.state.stage = None  # what Lightning does after its teardown, before it re-raises
        raise ending

    trainer._teardown = _teardown


def optimizer_stepped(trainer: Any) -> bool:
    """Whether the batch that just ended stepped the optimizer (not mid-accumulation)."""
    return not trainer.fit_loop.epoch_loop._should_accumulate()


def hpc_checkpoint(trainer: Any, directory: str) -> tuple[str, Callable[[], dict[str, Any]]]:
    """The path of the next ``hpc_ckpt_<N>.ckpt`` in ``directory`` and a function that dumps the
    checkpoint's contents."""
    connector = trainer._checkpoint_connector
    return connector.hpc_save_path(directory), lambda: connector.dump_checkpoint(weights_only=False)


def saved_loader_positions(checkpoint: dict[str, Any]) -> list[dict[str, Any]]:
    """The training loaders' positions (their ``state_dict``, in the order of the fit's loaders) that the fit loop
    saved in ``checkpoint``; empty where no loader had one."""
    return list(checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {}).get("combined_loader", []))


def has_position(loader: Any) -> bool:
    """Whether the fit loop saves ``loader``'s position in a checkpoint: it has ``state_dict`` and
    ``load_state_dict`` (torchdata's StatefulDataLoader; torch's DataLoader has neither)."""
    return epoch_order.has_state(loader)


def training_loaders(trainer: Any) -> list[Any]:
    """The fit's training loaders (those of its CombinedLoader), once its data is set up; else empty."""
    loaders = trainer.fit_loop._combined_loader
    return [] if loaders is None else list(loaders.flattened)


def epoch_now(trainer: Any) -> int:
    """The epoch the fit is in (the one a resumed fit resumes in)."""
    return int(trainer.fit_loop.epoch_progress.current.processed)


def batches_this_epoch(trainer: Any) -> int:
    """The training batches of this epoch run to their end (the one being ended included, at its batch end)."""
    return int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)


def set_epoch_length(trainer: Any, batches: int | float, limits: list[int | float] | None = None) -> tuple[
        int | float, list[int | float] | None]:
    """Make the fit's current epoch ``batches`` long (``limits``: the training loaders' own, default ``batches`` for
    each); Lightning reads the length from the loaders once, when it sets them up. Returns the length and limits it
    replaced."""
    fit_loop = trainer.fit_loop
    loaders = fit_loop._combined_loader
    before = fit_loop.max_batches, None if loaders is None else loaders.limits
    fit_loop.max_batches = batches
    if loaders is not None:
        loaders.limits = limits if limits is not None else [batches] * len(loaders.flattened)
    return before


def is_sampler_wrapper(cls: type) -> bool:
    """Whether ``cls`` is Lightning's DistributedSamplerWrapper (either distribution's)."""
    return cls.__name__ == SAMPLER_WRAPPER and cls.__module__.startswith(_LIGHTNING_PACKAGES)


def wrapped_sampler(sampler: Any) -> Any | None:
    """The sampler that Lightning's DistributedSamplerWrapper ``sampler`` wraps; None for any other sampler."""
    return sampler.dataset._sampler if any(is_sampler_wrapper(cls) for cls in type(sampler).__mro__) else None


def restore_loader_positions(trainer: Any, positions: list[dict[str, Any]], start_over: Iterable[Any] = ()) -> bool:
    """At the start of a resumed fit, give the training loaders back ``positions`` (see
    :func:`saved_loader_positions`) for the epoch the fit resumes in; the data fetcher's iterator must then be made
    again from them (:func:`remake_iterator`). Lightning loads the positions before the loop sets its samplers'
    epoch: a shuffling sampler that draws its order as the iterator is made (torch's DistributedSampler, or any
    sampler the loader's workers prefetch from) then resumes in epoch 0's order at the saved offset. And it drops
    them when the data was set up before the restore (``trainer.estimated_stepping_batches`` in
    ``configure_optimizers``: #20550). The loaders of ``start_over`` get none: their epoch starts over. True if it
    gave any back."""
    fit_loop = trainer.fit_loop
    loaders = training_loaders(trainer)
    if not positions or not loaders or fit_loop._data_fetcher is None:
        return False
    # the fit loop saved one position per loader that has state_dict and load_state_dict, in this order
    stateful = [loader for loader in loaders if has_position(loader)]
    if len(stateful) != len(positions):  # not the loaders that were saved: Lightning raises on its own path
        return False
    epoch = epoch_now(trainer)
    for loader in loaders:
        samplers = (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None))
        for set_epoch in {id(sampler): getattr(sampler, "set_epoch", None) for sampler in samplers}.values():
            if callable(set_epoch):
                set_epoch(epoch)
    fresh = {id(loader) for loader in start_over}
    for loader, position in zip(stateful, positions):
        if id(loader) not in fresh:
            loader.load_state_dict(position)
    fit_loop._combined_loader_states_to_load = []  # given back here, where Lightning dropped them (#20550)
    return len(fresh) < len(stateful)


def remake_iterator(trainer: Any) -> None:
    """Make the fit's data fetcher's iterator again, from the training loaders as they are now."""
    fetcher = trainer.fit_loop._data_fetcher
    if fetcher is not None:
        iter(fetcher)


def _no_broadcast() -> None:
    """Replaces Lightning's per-batch broadcast of rank 0's flag; the agreement decides instead."""


def _ignore(signum: int, frame: Any) -> None:
    """Replaces Lightning's SLURM SIGTERM handler, which only logs, from inside the signal handler."""


# -- the loggers' runs --------------------------------------------------------------------------------
_LIGHTNING_PACKAGES = ("lightning.", "pytorch_lightning.", "lightning_fabric.")


def logger_kind(logger: Any) -> str | None:
    """The name of the class of :data:`LOGGERS` that ``logger`` is (or subclasses), None for any other logger."""
    for cls in type(logger).__mro__:
        if cls.__name__ in LOGGERS and cls.__module__.startswith(_LIGHTNING_PACKAGES):
            return cls.__name__
    return None


def logger_run(logger: Any, kind: str) -> Any:
    """The run ``logger`` (of :func:`logger_kind` ``kind``) writes to, if it is fixed already (given to it, or chosen
    when it made its run): TensorBoard's and CSV's version, W&B's and MLflow's run id. None: it is chosen later, when
    the logger first needs it."""
    if kind == "WandbLogger":
        if logger._experiment is not None:
            return logger._experiment.id
        active = getattr(sys.modules.get("wandb"), "run", None)  # a run the script made: the logger will take it
        return active.id if active is not None else logger._id
    if kind == "MLFlowLogger":
        return logger._run_id
    return logger._version


def logger_made(logger: Any, kind: str) -> bool:
    """Whether ``logger`` has made its run (its writer, its W&B run, its MLflow run) already."""
    if kind == "MLFlowLogger":
        return bool(logger._initialized)
    return logger._experiment is not None


def give_logger_run(logger: Any, kind: str, run: Any) -> None:
    """Make ``logger`` (see :func:`logger_run`, which must be None) write to ``run`` when it makes its run. A CSV
    logger makes its writer now, keeping the ``metrics.csv`` that Lightning's writer deletes in a folder it finds
    not empty, and appends to it."""
    if kind == "WandbLogger":
        logger._id = run
        logger._wandb_init.update(id=run, resume="allow")
    elif kind == "MLFlowLogger":
        logger._run_id = run
    else:
        logger._version = run
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


# -- Fabric ------------------------------------------------------------------------------------------
def validate_launched(fabric: Any) -> None:
    """Fabric's own error when ``launch()`` has not run yet."""
    fabric._validate_launched()


def fabric_callbacks(fabric: Any) -> list[Any]:
    callbacks: list[Any] = fabric._callbacks
    return callbacks


# -- Lightning's launcher ----------------------------------------------------------------------------
def retire_child_watch(decision: object = None) -> None:
    """Make Lightning's child-process watch, if this process runs one, end at its next wake without
    acting (an "on decided" action of the coordinator).

    Rank 0 of Lightning's own launcher (``Trainer(devices=N)``, ``fabric.launch()`` without torchrun or
    srun) runs a thread that wakes every 5 s and, once a child has exited non-zero, SIGKILLs every rank,
    rank 0 included. After an agreed stop every rank exits on its own with 128 + signal: a child a moment
    faster than rank 0 would have rank 0 SIGKILLed (-9 instead of 143). Called at the agreed stop, while
    every rank is still alive, so the watch has nothing to act on at that moment; a rank that then fails
    to exit is the stop deadline's to end. (Where nothing follows the agreement — a stop in
    validate/test/predict, no checkpoint — another rank could in principle exit before rank 0 retires the
    watch; the watch wakes every 5 s, the gap is milliseconds.)"""
    for thread in threading.enumerate():
        if type(thread).__name__ == CHILD_WATCH:
            thread._run = _stop_watching  # type: ignore[attr-defined]


def _stop_watching() -> bool:
    return True  # the watch's loop takes True as "finished"
