"""Every private name of Lightning the package reaches, with the first release that has it, and the Trainer's
accessors (the loaders' and loggers' are in :mod:`resume_internals`).
Setting an attribute never fails, so the callback checks these lists (:func:`missing`) before it changes anything and
the canary, ``tests/test_internals.py``, names a missing one. Behaviour is gated on the version (:func:`at_least`),
never on ``hasattr``; docs/how-it-works.md has the account.
"""

from __future__ import annotations

import dataclasses
import importlib
import operator
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Iterable
from types import FrameType, ModuleType
from typing import Any

from lightning_utilities.core.imports import compare_version
from packaging.version import Version

CHECKED = ("2.5.1", "2.5.2", "2.5.6", "2.6.0", "2.6.6")
"""The releases of ``lightning`` and ``pytorch_lightning`` checked (``make test-versions``); those between agree."""


@dataclasses.dataclass(frozen=True)
class Internal:
    """A private name, as a dotted path from the object the integration holds, in every release from ``since`` on."""

    path: str
    why: str
    since: str = CHECKED[0]


TRAINER = (
    Internal("_accelerator_connector.cluster_environment", "the SLURM environment and its requeue signal"),
    Internal("_signal_connector._sigterm_notifier_fn", "replaced by the recorder (2.5.2+ broadcasts in the handler)"),
    Internal("_signal_connector._slurm_sigusr_handler_fn", "replaced by the recorder (it saves and requeues there)"),
    Internal("_signal_connector._sigterm_handler_fn", "replaced (under SLURM it logs from inside the handler)"),
    Internal("_signal_connector._original_handlers", "restored by Lightning at teardown: SIG_IGN after a stop"),
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
BEFORE_RUN = (Internal("_checkpoint_connector._select_ckpt_path", "the checkpoint chosen, then the loggers' runs"),)
FABRIC = (
    Internal("_validate_launched", "Fabric's own error when unison_stop() comes before launch()"),
    Internal("_callbacks", "the FabricStop that holds the job's coordinator"),
)
_VERSION = Internal("_version", "its version, given back before it is resolved")
LOGGERS = {  # the loggers whose run a resume continues (Lightning's classes of these names, and subclasses)
    "TensorBoardLogger": (_VERSION, Internal("_experiment", "its writer, once made")),
    "CSVLogger": (_VERSION, Internal("_experiment", "its writer, made at once where it would delete metrics.csv")),
    "WandbLogger": (Internal("_id", "the W&B run's id, given back before wandb.init"),
                    Internal("_wandb_init", "wandb.init's arguments: the id and resume='allow'"),
                    Internal("_experiment", "its run, once wandb.init has made it")),
    "MLFlowLogger": (Internal("_run_id", "the MLflow run's id, given back before the run is made"),
                     Internal("_initialized", "whether its run is made")),
}
SAMPLER_WRAPPER = "DistributedSamplerWrapper"  # deals places of the order its ``dataset`` draws from the wrapped one
WRAPPED = (Internal("dataset._sampler", "the sampler it wraps, whose generator a resume gives back"),)
CHILD_WATCH = "_ChildProcessObserver"  # the thread by which Lightning's launcher SIGKILLs every rank after a failure
LAUNCHER = (Internal(f"{CHILD_WATCH}._run", "the child-process watch of Lightning's launcher, retired at a stop"),)

LIGHTNING_PACKAGES = ("lightning.", "pytorch_lightning.", "lightning_fabric.")
RUN_NAMES = {"TensorBoardLogger": "_version", "CSVLogger": "_version", "WandbLogger": "_id", "MLFlowLogger": "_run_id"}
EpochLength = tuple[int | float, list[int | float] | None]  # the fit loop's batches in an epoch, the loaders' limits
_warned: set[str] = set()


def launchers(fabric: str) -> ModuleType | None:
    """The module of ``fabric``'s launcher watch, None if it is gone."""
    try:
        return importlib.import_module(f"{fabric}.strategies.launchers.subprocess_script")
    except ImportError:
        return None


def at_least(distribution: str, version: str) -> bool:
    return bool(compare_version(distribution, operator.ge, version))


def missing(owner: Any, internals: Iterable[Internal], distribution: str) -> list[str]:
    """The paths of ``internals`` that ``owner`` (None: all) lacks, among those its release should have."""
    return [f"{internal.path} ({internal.why})" for internal in internals
            if owner is None or (at_least(distribution, internal.since) and not _has(owner, internal.path))]


def _has(owner: Any, path: str) -> bool:
    for name in path.split("."):
        if not hasattr(owner, name):
            return False
        owner = getattr(owner, name)
    return True


def untested(distribution: str, version: str) -> str | None:
    """A warning for a release outside :data:`CHECKED`'s range, else None."""
    release = Version(version).release
    if Version(CHECKED[0]).release <= release <= Version(CHECKED[-1]).release:
        return None
    return (f"ddp_sigterm was tested with {distribution} {CHECKED[0]} to {CHECKED[-1]} ({', '.join(CHECKED)}); this is "
            f"{distribution} {version}: the Lightning internals it needs are present, but the stop is untested here")


def warn_once(message: str) -> None:
    """One warning per message and process (the callback's set-up runs for every Trainer)."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)


# -- the Trainer -------------------------------------------------------------------------------------
def requeue_signal(trainer: Any, slurm_environment: type[Any]) -> int | None:
    """SLURM's requeue signal under SLURM with auto-requeue on, else None."""
    environment = trainer._accelerator_connector.cluster_environment
    if isinstance(environment, slurm_environment) and environment.auto_requeue:
        return int(environment.requeue_signal)
    return None


def routed_signals(requeue: int | None) -> tuple[int, ...]:
    return (signal.SIGTERM,) + (() if requeue is None else (requeue,))


def take_signal_handlers(trainer: Any, record: Callable[[int, Any], Any], distribution: str) -> None:
    """Route the Trainer's SIGTERM and requeue signal to ``record``; switch off rank 0's per-batch broadcast."""
    connector = trainer._signal_connector
    connector._sigterm_notifier_fn = record
    connector._slurm_sigusr_handler_fn = record
    connector._sigterm_handler_fn = _ignore  # under SLURM it only logs, from inside the handler
    if at_least(distribution, "2.5.2"):
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = _no_broadcast


def restore_trainer(trainer: Any) -> None:
    """Undo :func:`take_signal_handlers` and :func:`resume_when_not_told` (instance attributes shadow methods)."""
    for name in ("_sigterm_notifier_fn", "_slurm_sigusr_handler_fn", "_sigterm_handler_fn"):
        trainer._signal_connector.__dict__.pop(name, None)
    trainer.fit_loop.epoch_loop.__dict__.pop("_broadcast_sigterm_tensor", None)
    trainer._checkpoint_connector.__dict__.pop("resume_start", None)


def resume_when_not_told(trainer: Any, choose: Callable[[], str | None]) -> None:
    """Make a ``fit`` started without ``ckpt_path`` load ``choose()``'s checkpoint, if any (every rank calls it)."""
    connector = trainer._checkpoint_connector
    lightnings = type(connector).resume_start.__get__(connector)

    def resume_start(checkpoint_path: Any = None, *args: Any, **kwargs: Any) -> Any:
        if checkpoint_path is None and trainer.state.fn == "fit":
            checkpoint_path = choose()
        return lightnings(checkpoint_path, *args, **kwargs)

    connector.resume_start = resume_start


def trainer_being_made(trainer_class: type[Any]) -> Any | None:
    """The ``trainer_class`` whose ``__init__`` runs in this thread (it calls ``callbacks_factory``), or None."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        found = frame.f_locals.get("self") if frame.f_code.co_name == "__init__" else None
        if isinstance(found, trainer_class):
            return found
        frame = frame.f_back
    return None


class CheckpointChoice:
    """A Trainer's ``_checkpoint_connector._select_ckpt_path`` that then runs ``then(trainer, stage, path)``,
    before ``Trainer._run`` makes the loggers' runs. A module-level class, so that ``ddp_spawn`` can pickle it."""

    def __init__(self, connector: Any, then: Callable[[Any, str, Any], None]) -> None:
        self.connector, self.then = connector, then

    def __call__(self, state_fn: Any, ckpt_path: Any, *args: Any, **kwargs: Any) -> Any:
        path = type(self.connector)._select_ckpt_path(self.connector, state_fn, ckpt_path, *args, **kwargs)
        self.then(self.connector.trainer, str(getattr(state_fn, "value", state_fn)), path)
        return path


def before_run(trainer: Any, then: Callable[[Any, str, Any], None]) -> None:
    """Make ``then`` run at every choice of ``trainer``'s checkpoint (:class:`CheckpointChoice`)."""
    connector = trainer._checkpoint_connector
    if not isinstance(connector.__dict__.get("_select_ckpt_path"), CheckpointChoice):
        connector._select_ckpt_path = CheckpointChoice(connector, then)


def mark_stopped(trainer: Any, ignore: Iterable[int]) -> None:
    """Set Lightning's flag, as its handler would; SIG_IGN for ``ignore`` at teardown: a late signal changes nothing."""
    originals = trainer._signal_connector._original_handlers
    originals.update({signum: signal.SIG_IGN for signum in ignore if signum in originals})
    trainer._signal_connector.received_sigterm = True


def raise_after_teardown(trainer: Any, ending: BaseException) -> None:
    """Make the Trainer's teardown for the exception on its way out raise ``ending`` once Lightning's has run."""
    lightnings = type(trainer)._teardown.__get__(trainer)

    def _teardown() -> None:
        del trainer._teardown
        lightnings()
        trainer.state.stage = None  # what Lightning does after its teardown, before it re-raises
        raise ending

    trainer._teardown = _teardown


def optimizer_stepped(trainer: Any) -> bool:
    return not trainer.fit_loop.epoch_loop._should_accumulate()


def hpc_checkpoint(trainer: Any, directory: str) -> tuple[str, Callable[[], dict[str, Any]]]:
    """The next ``hpc_ckpt_<N>.ckpt`` in ``directory`` and a function that dumps its contents."""
    connector = trainer._checkpoint_connector
    return connector.hpc_save_path(directory), lambda: connector.dump_checkpoint(weights_only=False)


def _no_broadcast() -> None:
    """Replaces Lightning's per-batch broadcast of rank 0's flag; the agreement decides instead."""


def _ignore(signum: int, frame: Any) -> None:
    """Replaces Lightning's SLURM SIGTERM handler, which only logs, from inside the signal handler."""


# -- Fabric and Lightning's launcher --------------------------------------------------------------------
def validate_launched(fabric: Any) -> None:
    fabric._validate_launched()


def fabric_callbacks(fabric: Any) -> list[Any]:
    callbacks: list[Any] = fabric._callbacks
    return callbacks


def retire_child_watch(decision: object = None) -> None:
    """End Lightning's child-process watch at its next wake: it would SIGKILL rank 0 for the ranks' 128 + signal."""
    for thread in threading.enumerate():
        if type(thread).__name__ == CHILD_WATCH:
            thread._run = lambda: True  # type: ignore[attr-defined]  # the watch's loop takes True as "finished"
