"""A user's training script, unchanged: it never imports ddp_sigterm (the entry point does the work).

The test harness describes the job in one environment variable (a :class:`scenario.Job`, read once here) and
reads back, per rank, ``outcome.rank<R>.json`` (what the script saw) and ``progress.rank<R>`` (batches as they
start).
Fault injection is a callback: it sends a signal to this very process at rank R, batch B, phase P.
"""

from __future__ import annotations

import atexit
import hashlib
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import torch
from ddp_sigterm_tests.scenario import Job
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

JOB = Job.read()
SCENARIO = JOB.scenario


class ExitFunctions:
    """The functions registered with ``atexit`` from here on and not unregistered (atexit cannot list them)."""

    def __init__(self) -> None:
        self.live: list = []
        self._register, self._unregister = atexit.register, atexit.unregister
        atexit.register, atexit.unregister = self.register, self.unregister

    def register(self, func, *args, **kwargs):
        self.live.append(func)
        return self._register(func, *args, **kwargs)

    def unregister(self, func) -> None:
        self.live = [f for f in self.live if f != func]
        self._unregister(func)

    def names(self) -> list[str]:
        return sorted(f"{getattr(f, '__module__', '?')}.{getattr(f, '__qualname__', type(f).__name__)}"
                      for f in self.live)


pl = importlib.import_module(SCENARIO.trainer_package)  # lightning.pytorch, or the standalone pytorch_lightning
# after Lightning's import (what it registers then depends on the optional packages of the environment),
# before the Trainer loads the package through its entry point
exit_functions = ExitFunctions()
Callback = pl.Callback
OUT = JOB.out
ROOT = SCENARIO.root_dir or OUT  # default_root_dir
VAL_SLEEP = SCENARIO.step_sleep if SCENARIO.val_sleep is None else SCENARIO.val_sleep
# Under torchrun --max-restarts: the attempt this process belongs to; the faults are sent in the first one only.
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
INJECT = SCENARIO.injections() if ATTEMPT == 0 else []
# Run by the patched Lightning (no package): its stop raises SIGTERMException on every rank at the same step and saves
# nothing itself; the stop's checkpoint is Lightning's OnExceptionCheckpoint, as a user of that Lightning adds to a fit.
ON_EXCEPTION_CHECKPOINT = JOB.implementation == "patched" and SCENARIO.stage == "fit"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


class Numbers(Dataset):
    def __init__(self, n: int) -> None:
        gen = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, 16, generator=gen)
        self.y = torch.randn(n, 1, generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        if SCENARIO.payload_mb:  # state that makes the checkpoint that much bigger (a larger model's weights, say)
            self.register_buffer("payload", torch.ones(SCENARIO.payload_mb * 2**18))

    def training_step(self, batch, batch_idx):
        injector.at("forward")
        slow = SCENARIO.slow_phase
        time.sleep(slow[1] if slow and injector.batch >= slow[0] else SCENARIO.step_sleep)
        if self.global_step == SCENARIO.raise_at_step:
            raise RuntimeError(f"rank {self.global_rank} crashes at step {self.global_step} (raise_at_step)")
        x, y, index = batch
        if SCENARIO.record_samples:
            with open(os.path.join(OUT, f"samples.rank{self.global_rank}"), "a") as samples:
                samples.write(f"{self.global_step} {self.current_epoch} {' '.join(str(int(i)) for i in index)}\n")
        if SCENARIO.data_by_step:
            generator = torch.Generator().manual_seed(1000 * self.global_step + self.global_rank)
            x, y = torch.randn(x.shape, generator=generator), torch.randn(y.shape, generator=generator)
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if SCENARIO.loggers:
            self.log("train_loss", loss)
        return loss

    def configure_model(self) -> None:
        if SCENARIO.strategy == "fsdp2":  # every layer with weights, then the whole: FSDP2's usual way
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if any(True for _ in layer.parameters()):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def on_after_backward(self) -> None:
        injector.at("backward")

    def validation_step(self, batch, batch_idx):
        injector.at("validation", batch_idx + 1)
        time.sleep(VAL_SLEEP)
        x, y, _ = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.validation_step(batch, batch_idx)

    def on_save_checkpoint(self, checkpoint) -> None:
        injector.at("save")
        if self.global_rank == SCENARIO.fail_save_on_rank:  # after rank 0 may have written its part: what is left?
            raise RuntimeError(f"rank {self.global_rank} cannot save: disk quota exceeded (fail_save_on_rank)")

    def predict_step(self, batch, batch_idx):
        injector.at("validation", batch_idx + 1)
        time.sleep(VAL_SLEEP)
        return self.net(batch[0])

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
        if SCENARIO.stepping_batches:  # as OneCycleLR(total_steps=...) does: Lightning sets the data up here
            assert self.trainer.estimated_stepping_batches > 0
        if not SCENARIO.epoch_lr_decay:
            return optimizer
        # halves the learning rate at every epoch end: a resume that loses or repeats that step shows in the weights
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]

    def train_dataloader(self):
        kind, sampler = DataLoader, DistributedSampler
        if SCENARIO.train_loader == "stateful":
            from torchdata.stateful_dataloader import StatefulDataLoader
            from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

            kind, sampler = StatefulDataLoader, StatefulDistributedSampler
        return self._loader(SCENARIO.batches, kind=kind, samples=SCENARIO.samples, shuffle=SCENARIO.shuffle == "loader",
                            sampler=(lambda dataset: sampler(dataset, shuffle=True)) if SCENARIO.shuffle == "sampler"
                            else None)

    def val_dataloader(self):
        return self._loader(SCENARIO.val_batches, extra=int(SCENARIO.uneven))

    test_dataloader = predict_dataloader = val_dataloader

    def _loader(self, batches: int, extra: int = 0, kind: type = DataLoader, samples: int = 0, shuffle: bool = False,
                sampler: Callable[[Dataset], Sampler] | None = None) -> DataLoader:
        world = self.trainer.world_size
        workers = SCENARIO.num_workers
        dataset = Numbers(samples or batches * 4 * world + extra)
        return kind(dataset, batch_size=4, num_workers=workers, shuffle=shuffle,
                    sampler=None if sampler is None else sampler(dataset), persistent_workers=workers > 0)


class Injector(Callback):
    """Sends the configured signal to this process at (rank, batch, phase); logs batch starts."""

    def __init__(self) -> None:
        self.rank = -1
        self.batch = 0
        self.injected_at: float | None = None
        self.progress = None
        self.sent: set[int] = set()  # indices of INJECT entries already sent
        self.last_sent = 0.0

    def setup(self, trainer, pl_module, stage):  # before the package's: the entry point's callbacks come after
        self.rank = trainer.global_rank
        if SCENARIO.gloo_ifname and self.rank == SCENARIO.gloo_ifname[0]:
            os.environ["GLOO_SOCKET_IFNAME"] = SCENARIO.gloo_ifname[1]
        # open for the whole run, line-buffered: the test reads it while the job runs
        self.progress = open(os.path.join(OUT, f"progress.rank{self.rank}"), "a", buffering=1)  # noqa: SIM115

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batch += 1
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        self.progress.write(f"train {self.batch} step {trainer.global_step} epoch {trainer.current_epoch} "
                            f"idx {batch_idx} lr {lr}\n")
        self.at("batch_start")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.at("optimizer")

    def on_train_epoch_end(self, trainer, pl_module):
        self.at("epoch_end", self.batch)

    def on_train_end(self, trainer, pl_module):
        self.at("train_end", self.batch)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self.progress.write(f"val {batch_idx + 1} step {trainer.global_step}\n")

    def at(self, phase: str, batch: int | None = None) -> None:
        batch = self.batch if batch is None else batch
        for index, injected in enumerate(INJECT):
            if index in self.sent or not injected.matches(self.rank, batch, phase):
                continue
            if SCENARIO.signal_gap and self.sent:  # a separate request, not a repeat of the previous one
                time.sleep(max(0.0, self.last_sent + SCENARIO.signal_gap - time.monotonic()))
            self.sent.add(index)
            self.last_sent = time.monotonic()
            if self.injected_at is None:
                if SCENARIO.lock_root:
                    lock(ROOT)
                self.injected_at = time.monotonic()
            os.kill(os.getpid(), injected.signum)


class ThenProgress(Callback):
    """Logs the batches of the one-device run (``then <batch>``), where the harness can signal it."""

    def __init__(self, progress) -> None:
        self.progress = progress

    def on_test_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self.progress.write(f"then {batch_idx + 1} step {trainer.global_step}\n")


def test_on_one_device(model: pl.LightningModule) -> None:
    one = pl.Trainer(accelerator="cpu", devices=1, num_nodes=1, limit_test_batches=SCENARIO.val_batches,
                     default_root_dir=ROOT, enable_progress_bar=False, enable_model_summary=False, logger=False,
                     callbacks=[ThenProgress(injector.progress)])
    one.test(model)


def left_behind(threads_before: set[int]) -> dict:
    """What the process holds after a run: threads started since ``threads_before`` (idents), the stop
    signals' handlers, the wakeup fd and the exit functions registered since the start."""
    wakeup = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup)
    handlers = {}
    for signum in STOP_SIGNALS:
        handler = signal.getsignal(signum)
        handlers[signal.Signals(signum).name] = handler.name if isinstance(handler, signal.Handlers) else \
            getattr(handler, "__qualname__", type(handler).__name__)
    return {"threads": threads_left(threads_before), "handlers": handlers, "wakeup_fd": wakeup,
            "exit_functions": exit_functions.names()}


def lock(path: str) -> None:
    os.chmod(path, 0o555)  # noqa: S103 - read-only for everyone is the point: the save must fail
    if os.geteuid() == 0:  # root writes anywhere a mode allows nothing; an immutable directory stops it
        subprocess.run(["chattr", "+i", path], check=True)


injector = Injector()


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's weights: under FSDP2, its own shards (no collective: a rank may be on its way out alone)."""
    return {name: (tensor.to_local() if hasattr(tensor, "to_local") else tensor).detach().cpu()
            for name, tensor in model.state_dict().items()}


def weights_digest(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for tensor in weights(model).values():
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


def strategy():
    """The scenario's strategy: ``fsdp2`` is ModelParallelStrategy with FSDP2 alone (every rank one data-parallel
    rank), which shards the model in ``configure_model``."""
    if SCENARIO.strategy == "fsdp2":
        return pl.strategies.ModelParallelStrategy(data_parallel_size=JOB.world_size, tensor_parallel_size=1)
    return SCENARIO.strategy or ("ddp" if JOB.world_size > 1 else "auto")


def threads_left(before: set[int]) -> list[str]:
    """Threads started since ``before`` (idents) and still alive; a DataLoader's queue threads end on their own."""
    return sorted(t.name for t in threading.enumerate() if t.ident not in before and t.name != "QueueFeederThread")


def loggers() -> list:
    """The scenario's loggers (see ``Scenario.loggers``)."""
    made, logs = [], os.path.join(ROOT, "logs")
    for name in SCENARIO.loggers:
        if name == "tensorboard":
            made.append(pl.loggers.TensorBoardLogger(logs, name="tb"))
        elif name == "csv":
            made.append(pl.loggers.CSVLogger(logs, name="csv"))
        elif name == "wandb":
            made.append(pl.loggers.WandbLogger(save_dir=logs, project="scenario", offline=True))
        else:
            made.append(pl.loggers.MLFlowLogger(experiment_name="scenario", tracking_uri=f"file:{ROOT}/mlruns"))
    return made


def main() -> None:
    threads_before = {t.ident for t in threading.enumerate()}
    pl.seed_everything(7, workers=True)
    model = Model()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=JOB.devices,
        num_nodes=int(os.environ["WORLD_SIZE"]) // JOB.devices if SCENARIO.elastic else JOB.num_nodes,
        strategy=strategy(),
        max_steps=-1 if SCENARIO.max_epochs else SCENARIO.max_steps,
        max_epochs=SCENARIO.max_epochs or None,
        limit_val_batches=None if SCENARIO.uneven else SCENARIO.val_batches,
        limit_test_batches=None if SCENARIO.uneven else SCENARIO.val_batches,
        limit_predict_batches=None if SCENARIO.uneven else SCENARIO.val_batches,
        val_check_interval=SCENARIO.val_every or SCENARIO.batches,
        num_sanity_val_steps=0,
        default_root_dir=ROOT,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=loggers() or False,
        log_every_n_steps=1 if SCENARIO.loggers else 50,  # (50: Lightning's default)
        enable_checkpointing=ON_EXCEPTION_CHECKPOINT or bool(SCENARIO.loggers),
        callbacks=[injector, *([pl.callbacks.OnExceptionCheckpoint(ROOT)] if ON_EXCEPTION_CHECKPOINT else [])],
    )
    outcome: dict = {"pid": os.getpid(), "exception": None, "exit_code": 0, "stop": None, "then": None}
    started = time.monotonic()
    try:
        if SCENARIO.stage == "fit":
            resume = os.path.join(ROOT, "on_exception.ckpt") if ON_EXCEPTION_CHECKPOINT else "hpc"
            trainer.fit(model, ckpt_path=resume if SCENARIO.resume else None)
            if SCENARIO.then_test_on_one_device and trainer.is_global_zero:
                outcome["then"] = "started"
                test_on_one_device(model)
                outcome["then"] = "finished"
        elif SCENARIO.stage in ("validate", "test", "predict"):
            getattr(trainer, SCENARIO.stage)(model)
        else:  # "all"  # back to back, with what each run leaves behind
            outcome["left_behind"] = {}
            for stage in ("fit", "validate", "test", "predict"):
                getattr(trainer, stage)(model)
                outcome["left_behind"][stage] = left_behind(threads_before)
    except SystemExit as exit_:
        said = f": {exit_}" if exit_.args and isinstance(exit_.args[0], str) else ""  # StopError's message
        outcome.update(exception=type(exit_).__name__ + said, exit_code=exit_.code or 0)
        stop = getattr(exit_, "stop", None)
        outcome["stop"] = None if stop is None else {k: getattr(stop, k) for k in stop.__dataclass_fields__}
        raise
    except BaseException as error:
        outcome.update(exception=f"{type(error).__name__}: {error}", exit_code=1)
        raise
    finally:
        outcome.update(
            rank=trainer.global_rank,
            predict_batches=trainer.predict_loop.batch_progress.total.completed,
            world_size=trainer.world_size,
            global_step=trainer.global_step,
            batches_started=injector.batch,
            injected_at=injector.injected_at,
            started_at=started,
            ended_at=time.monotonic(),
            weights=weights_digest(model),
            callbacks=[type(cb).__name__ for cb in trainer.callbacks],
            attempt=ATTEMPT,
            lightning=pl.__version__,
            trainer_package=pl.__name__,
            environment=type(trainer._accelerator_connector.cluster_environment).__name__,
        )
        with open(os.path.join(OUT, f"outcome.rank{trainer.global_rank}.json"), "w") as f:
            json.dump(outcome, f)
        if SCENARIO.keep_weights:
            torch.save(weights(model), os.path.join(OUT, f"weights.rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    main()
    sys.exit(0)
