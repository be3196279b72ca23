"""What a scenario job does, described once: the :class:`Scenario` a test asks for, and the :class:`Job` the
harness hands to every process of it, as JSON in one environment variable, ``SCENARIO``.

A test writes ``fit(tmp_path, Scenario(inject="1:2:forward", step_sleep=0.001))``; harness.py adds what the
launch decides (the job's directory, the ranks per node and the nodes, which fix runs) and serialises the
:class:`Job`; the job's script (scenario_train.py, the benchmarks' jobs) reads it once with
:meth:`Job.read`. What configures the harness itself (which Python runs the job, which fix that Python has,
which Lightning release it must report) stays in environment variables the harness reads: see harness.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from ddp_sigterm_tests import injection

VARIABLE = "SCENARIO"
STAGES = ("fit", "validate", "test", "predict", "all")
TRAINER_PACKAGES = ("lightning.pytorch", "pytorch_lightning")
IMPLEMENTATIONS = ("package", "patched")
LOGGERS = ("tensorboard", "csv", "wandb", "mlflow")


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A training job of scenario_train.py: what it trains, how long its steps take, and the faults it sends itself.
    The defaults: a fit of 12 steps of 20 ms, no signal."""

    stage: str = "fit"
    """``fit``, ``validate``, ``test``, ``predict``, or ``all``: the four back to back, each rank recording
    what every run leaves behind in its process (threads, signal handlers, wakeup fd, exit functions)."""
    trainer_package: str = "lightning.pytorch"
    """The Trainer's package: ``lightning.pytorch``, or the standalone ``pytorch_lightning``."""
    max_steps: int = 12
    """Training steps (optimizer steps) of the fit."""
    max_epochs: int = 0
    """When set, epoch-based training: ``max_steps`` is ignored."""
    batches: int = 8
    """Training batches per epoch, per rank."""
    val_batches: int = 4
    """Validation batches per rank (test and prediction batches too)."""
    val_every: int | None = None
    """Validation after every that many training batches; None: at the end of each epoch (``batches``)."""
    step_sleep: float = 0.02
    """Seconds of work per training step."""
    val_sleep: float | None = None
    """Seconds per validation, test or prediction batch; None: ``step_sleep``."""
    slow_phase: tuple[int, float] | None = None
    """``(batch, seconds)``: from that training batch on (counted from 1 in the run), each step takes that long
    instead of ``step_sleep`` (a data stall, a slower phase of training)."""
    uneven: bool = False
    """One more evaluation sample and no limit on evaluation batches: prediction shards its data without padding,
    so rank 0 then predicts one batch more than the others."""
    num_workers: int = 0
    """DataLoader workers of every loader (persistent when there are any)."""
    train_loader: str = "plain"
    """The training loader's class: ``plain`` (torch's DataLoader, which has no position to save) or ``stateful``
    (torchdata's StatefulDataLoader: Lightning saves its position in a checkpoint and restores it)."""
    shuffle: str = ""
    """What shuffles the training data: ``""``, the DistributedSampler Lightning puts in (it shuffles training data
    by epoch whatever the loader says); ``sampler``, a shuffling distributed sampler the loader is given
    (torchdata's StatefulDistributedSampler for a StatefulDataLoader, torch's DistributedSampler otherwise), which
    Lightning leaves in place; ``loader``, the loader's own ``shuffle=True`` (a StatefulDataLoader's is torchdata's
    RandomSampler, which Lightning wraps in its DistributedSamplerWrapper)."""
    samples: int = 0
    """Training samples; 0: ``batches`` batches of 4 per rank (so that many per rank at any world size)."""
    record_samples: bool = False
    """Each rank appends the dataset indices of every training batch to ``samples.rank<R>`` in the job's directory,
    a line per step: ``<global step> <epoch> <index> ...`` (the file is kept across jobs in one directory: a stop's
    and its resume's lines follow each other)."""
    stepping_batches: bool = False
    """``configure_optimizers`` reads ``trainer.estimated_stepping_batches``, as a OneCycleLR schedule does: Lightning
    then sets the training data up before it restores a checkpoint (Lightning #20550)."""
    loggers: tuple[str, ...] = ()
    """The Trainer's loggers, in order, among ``tensorboard``, ``csv``, ``wandb`` (offline) and ``mlflow`` (a file
    store): each writes under ``<root_dir>/logs`` (MLflow under ``<root_dir>/mlruns``), the training step logs
    ``train_loss`` at every step, and the Trainer's own ModelCheckpoint is on (its folder is the first logger's).
    None: ``logger=False`` and no ModelCheckpoint."""
    data_by_step: bool = False
    """Training batches are drawn from (global step, rank), not read from the DataLoader. Lightning resumes a stop
    inside an epoch at the epoch's first batch (a plain DataLoader has no position to restore); with this, a
    resumed run sees the batches an uninterrupted one sees, and its final weights must be the same."""
    epoch_lr_decay: bool = False
    """Halve the learning rate at every epoch end: a resume that loses or repeats that step shows in the weights."""
    payload_mb: int = 0
    """The checkpoint grows by this many MiB (a buffer of the model, as a larger model's weights)."""
    keep_weights: bool = False
    """Each rank also saves its final weights (``weights.rank<R>.pt``), to be compared within a float tolerance:
    with more than 2 ranks the gradients' sum depends on the order gloo adds them in, which DDP's bucket layout
    (rebuilt after a run's first step, so different in a resumed run) changes."""
    resume: bool = False
    """The fit resumes from the stop checkpoint (``ckpt_path="hpc"``; with the patched Lightning, its
    ``on_exception.ckpt``)."""
    root_dir: str = ""
    """``default_root_dir``, where checkpoints go (a path or a URL); empty: the job's directory."""
    lock_root: bool = False
    """The first signal the job sends itself first makes ``root_dir`` non-writable, even for root (chattr +i),
    as a full or read-only file system would be."""
    fail_save_on_rank: int | None = None
    """This rank cannot gather its part of the checkpoint: the model's ``on_save_checkpoint`` raises there (after
    rank 0 may have written its part)."""
    raise_at_step: int | None = None
    """Every rank's training step raises RuntimeError when ``trainer.global_step`` is this: a crash, with no signal
    (read from the Trainer: under ``ddp_spawn`` a rank's module-level state is not its callbacks')."""
    inject: str = ""
    """The signals the job sends itself, each once: ``rank:batch[:phase[:SIGNAL]]`` entries separated by ``;``
    (see injection.py), checked when the scenario is made."""
    signal_gap: float = 0.0
    """Seconds between two signals a process sends itself in one hook (a save's second and third)."""
    then_test_on_one_device: bool = False
    """After a fit that returned, global rank 0 tests the model with a second, one-device Trainer in the same
    process, as Lightning's documentation advises after a multi-device fit."""
    strategy: str = ""
    """The Trainer's strategy (``ddp_spawn``, ``ddp_notebook``, ...; ``fsdp2``: ModelParallelStrategy with FSDP2's
    ``fully_shard``, whose stop checkpoint is a folder of shards); empty: ``ddp`` with more than one rank."""
    elastic: bool = False
    """The Trainer's ``num_nodes`` is what torchrun's ``WORLD_SIZE`` says this attempt has (``--nnodes=MIN:MAX``: as
    many nodes as joined the rendezvous), as an elastic script must set it; else the launch's."""
    gloo_ifname: tuple[int, str] | None = None
    """``(rank, interface)``: once the training's process group is made, that rank makes its later gloo groups
    (the package's) on that network interface, which its peers cannot reach: a group of the package's own that
    cannot connect while the training's does (an NCCL job's gloo on the wrong interface; docs/multi-node.md)."""

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"unknown stage {self.stage!r}; known: {', '.join(STAGES)}")
        if self.train_loader not in ("plain", "stateful"):
            raise ValueError(f"unknown train_loader {self.train_loader!r}; known: plain, stateful")
        if self.shuffle not in ("", "sampler", "loader"):
            raise ValueError(f"unknown shuffle {self.shuffle!r}; known: '', sampler, loader")
        unknown = set(self.loggers) - set(LOGGERS)
        if unknown:
            raise ValueError(f"unknown loggers {sorted(unknown)}; known: {', '.join(LOGGERS)}")
        if self.trainer_package not in TRAINER_PACKAGES:
            raise ValueError(f"unknown Trainer package {self.trainer_package!r}; known: {', '.join(TRAINER_PACKAGES)}")
        self.injections()  # a typo fails in the test, not as a job that was never signalled

    def injections(self) -> list[injection.Injection]:
        """``inject``'s entries, in order."""
        return injection.parse(self.inject)


@dataclasses.dataclass(frozen=True)
class Job:
    """A scenario as the harness starts it: the :class:`Scenario`, and what the launch decides. Every process of
    the job reads the same one."""

    scenario: Scenario
    out: str
    """The job's directory: each rank writes ``outcome.rank<R>.json`` and ``progress.rank<R>`` there."""
    devices: int = 1
    """``Trainer(devices=...)``: the ranks of one node."""
    num_nodes: int = 1
    """``Trainer(num_nodes=...)``: one per rank when each rank is a process started by itself."""
    implementation: str = "package"
    """The fix that runs the job: ``package`` (ddp_sigterm installed), or ``patched`` (a Lightning built from
    patches/, without the package), whose stop checkpoint is Lightning's ``OnExceptionCheckpoint``, which the
    script then adds to a fit, as a user of that Lightning does."""

    def __post_init__(self) -> None:
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(f"unknown implementation {self.implementation!r}; known: {', '.join(IMPLEMENTATIONS)}")

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes

    def environment(self) -> dict[str, str]:
        """The environment variable that carries this job to its processes."""
        return {VARIABLE: json.dumps(dataclasses.asdict(self))}

    @classmethod
    def read(cls, environ: Mapping[str, str] = os.environ) -> Job:
        """The job :meth:`environment` described (JSON has lists where the fields have tuples)."""
        fields = json.loads(environ[VARIABLE])
        scenario: dict[str, Any] = {name: tuple(value) if isinstance(value, list) else value
                                    for name, value in fields.pop("scenario").items()}
        return cls(Scenario(**scenario), **fields)
