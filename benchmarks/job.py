"""One rank of a benchmark job: a tiny DDP model whose step does about BENCH_STEP seconds of work.

Started once per rank by benchmarks/bench.py, through the test harness. Two kinds (BENCH_KIND):

``cost``: the run is cut into blocks of BENCH_BLOCK steps, each run in one mode, the modes taking
turns (rotated every round, the same schedule on every rank since it follows the step number):

* ``nocheck``: no SIGTERM check at all (Lightning's per-step broadcast switched off too);
* ``stock``: the per-step broadcast from rank 0 of #20825, as released in 2.6.6 (and on Lightning's master);
* ``package``: ddp_sigterm with its defaults;
* ``patched``: the patched Lightning's vote, polled at every batch end: a vote at every batch, or 0.1 s apart when
  batches are faster (in the patched environment).

Comparing the modes inside one job, block against block, keeps the noise of a busy 2-core machine
(it moves whole jobs by +-15%) out of the ratios. A step's time is from its ``on_train_batch_start``
to the next one's; a block's first and last steps are dropped (a mode switch falls there).
Writes ``bench.rank<R>.json``: ``{"durations": {mode: [seconds, ...]}}``, and ``heartbeat``: what the package's
heartbeat cost this rank over the whole job (it runs through every block, so the modes' ratios cannot show
it): the seconds its thread spent on the CPU and the seconds the main thread waited for a heartbeat result;
with the cloud notice watcher on (DDP_SIGTERM_NOTICE), ``notice_cpu_s``: the CPU seconds of its thread.

``latency``: the environment's own fix with its defaults; rank BENCH_SIGNAL_RANK sends itself
SIGTERM at the start of training batch BENCH_SIGNAL_BATCH. Writes when the signal was sent, the
package's decision (if any), the step at the stop, and when the exception reached the script.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import lightning.pytorch as pl
import torch
from ddp_sigterm_tests.scenario import Job
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loops import utilities as loop_utilities
from torch.utils.data import DataLoader, TensorDataset

ENV = os.environ
JOB = Job.read()  # the harness's job: where to write, how many ranks
OUT = JOB.out
KIND = ENV.get("BENCH_KIND", "cost")
STEP = float(ENV.get("BENCH_STEP", "0.01"))
STEPS = int(ENV.get("BENCH_STEPS", "200"))
BLOCK = int(ENV.get("BENCH_BLOCK", "20"))
MODES = ENV.get("BENCH_MODES", "nocheck,stock,package").split(",")


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        time.sleep(STEP)  # the work of a step, without competing for the 2 cores
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        n = STEPS * 2 * self.trainer.world_size
        return DataLoader(TensorDataset(torch.randn(n, 8), torch.randn(n, 1)), batch_size=2)


class Modes(Callback):
    """Switches the SIGTERM check on and off block by block, and times every step."""

    def __init__(self) -> None:
        self.mode = MODES[0]
        self.starts: list[tuple[str, float]] = []

    def on_train_start(self, trainer, pl_module):
        # after the package's own set-up, which replaced the broadcast with a no-op on this instance
        epoch_loop = trainer.fit_loop.epoch_loop
        stock = getattr(type(epoch_loop), "_broadcast_sigterm_tensor", None)
        if stock is not None:
            epoch_loop._broadcast_sigterm_tensor = lambda: stock(epoch_loop) if self.mode == "stock" else None
        self.package = next((cb for cb in trainer.callbacks if type(cb).__name__ == "UnisonStop"), None)
        if self.package is not None:
            package_hook = self.package.on_train_batch_end
            self.package.on_train_batch_end = lambda *a: package_hook(*a) if self.mode == "package" else None
        vote = getattr(loop_utilities, "_SIGTERMVote", None)
        if vote is not None:  # the patched Lightning's training loop polls it at the end of each batch
            poll = vote.poll
            vote.poll = lambda sigterm, *args, **kwargs: (
                poll(sigterm, *args, **kwargs) if self.mode == "patched" else sigterm.trainer.received_sigterm
            )

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        step = trainer.global_step
        if step % BLOCK == 0:
            turn = step // BLOCK
            self.mode = MODES[(turn + turn // len(MODES)) % len(MODES)]
        self.starts.append((self.mode, time.perf_counter()))

    def durations(self) -> dict[str, list[float]]:
        found: dict[str, list[float]] = {mode: [] for mode in MODES}
        warm = BLOCK * len(MODES)  # the first round warms up data loading and caches
        for i in range(max(warm, 1), len(self.starts) - 1):
            mode, start = self.starts[i]
            if self.starts[i - 1][0] == mode and self.starts[i + 1][0] == mode:
                found[mode].append(self.starts[i + 1][1] - start)
        return found


class HeartbeatCost(Callback):
    """Times the main thread's waits for heartbeat results and reads the heartbeat thread's CPU clock."""

    THREADS = ("ddp_sigterm-heartbeat",)  # the package's (the patch has none)
    NOTICE_THREAD = "ddp_sigterm-notice"

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.cost: dict | None = None
        self.drivers: list = []
        try:
            from ddp_sigterm._core.port import Driver
        except ImportError:  # the patched Lightning: no package
            return
        init = Driver.__init__

        def kept(driver, *args, init=init, **kwargs):  # every driver of the job: its main thread's waits for a beat
            init(driver, *args, **kwargs)
            self.drivers.append(driver)

        Driver.__init__ = kept

    def on_train_end(self, trainer, pl_module):
        threads = [t for t in threading.enumerate() if t.name in self.THREADS]
        cpu = sum(time.clock_gettime(time.pthread_getcpuclockid(t.ident)) for t in threads if t.ident)
        self.cost = {"threads": len(threads), "cpu_s": cpu, "waited_s": sum(d.waited for d in self.drivers),
                     "wall_s": time.perf_counter() - self.started}
        # the cloud notice watcher's thread (BENCH_NOTICE jobs: local rank 0 polls a metadata service)
        watch = [t for t in threading.enumerate() if t.name == self.NOTICE_THREAD and t.ident]
        if watch:
            self.cost["notice_cpu_s"] = time.clock_gettime(time.pthread_getcpuclockid(watch[0].ident))


class SignalAt(Callback):
    def __init__(self, rank: int, batch: int) -> None:
        self.rank, self.batch, self.sent_at = rank, batch, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == self.rank and trainer.global_step + 1 == self.batch and self.sent_at is None:
            self.sent_at = time.monotonic()
            os.kill(os.getpid(), signal.SIGTERM)


def main() -> None:
    heartbeat = HeartbeatCost()
    if KIND == "cost":
        probe: Callback = Modes()
    else:
        probe = SignalAt(int(ENV.get("BENCH_SIGNAL_RANK", "1")), int(ENV.get("BENCH_SIGNAL_BATCH", "50")))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=JOB.num_nodes,
        strategy="ddp",
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[probe, heartbeat],
        default_root_dir=OUT,
    )
    result: dict = {"lightning": pl.__version__, "callbacks": [type(cb).__name__ for cb in trainer.callbacks]}
    try:
        trainer.fit(Tiny())
    except SystemExit as stop:
        decision = getattr(stop, "stop", None)
        result.update(exit_code=stop.code, exception_at=time.monotonic(), stop_step=trainer.global_step,
                      decision=None if decision is None else {k: getattr(decision, k)
                                                              for k in decision.__dataclass_fields__})
        raise
    finally:
        if KIND == "cost":
            result["durations"] = probe.durations()
            result["heartbeat"] = heartbeat.cost
        else:
            result["sent_at"] = probe.sent_at
        with open(os.path.join(OUT, f"bench.rank{trainer.global_rank}.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
