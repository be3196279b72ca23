"""Per-step cost of the SIGTERM check, on the installed Lightning (attached to the pull request).

    OMP_NUM_THREADS=1 torchrun --nproc-per-node=2 benchmark.py

Two CPU ranks (Gloo) train a tiny model whose step does 1 ms of work. Blocks of 40 steps take turns: the SIGTERM check
as the installed Lightning has it (on ``master``, #20825's broadcast from rank 0 at every batch; with the pull request,
``_SignalConnector.sigterm_agreed()``), then no check at all. Both halves run in the same job, so the ratio is not
moved by the noise between jobs. Rank 0 prints the median time per step of each half and their ratio. The heartbeat
thread of the pull request runs through both halves: its cost is not in the ratio.
"""

import statistics
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl

WORK, BLOCK, ROUNDS = 0.001, 40, 33


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        time.sleep(WORK)  # the work of a step, without competing for the cores
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Interleave(pl.Callback):
    """Switches the check on and off block by block and times every step."""

    def __init__(self) -> None:
        self.checking = False
        self.off_since = None
        self.starts = []

    def on_train_start(self, trainer, pl_module):
        connector = trainer._signal_connector
        self.agreement = getattr(connector, "_sigterm_agreement", None)
        if self.agreement is not None:  # the pull request: the loops ask the agreement
            agreed = connector.sigterm_agreed
            connector.sigterm_agreed = lambda force=False: agreed(force) if force or self.checking else False
        else:  # master: the broadcast at every batch
            loop = trainer.fit_loop.epoch_loop
            broadcast = loop._broadcast_sigterm_tensor
            loop._broadcast_sigterm_tensor = lambda: broadcast() if self.checking else None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        checking = (trainer.global_step // BLOCK) % 2 == 0
        if checking != self.checking and self.agreement is not None:
            # the agreement measures time per call: the steps without the check must not count as its calls' time
            if checking and self.off_since is not None:
                self.agreement._window_start += time.monotonic() - self.off_since
            self.off_since = None if checking else time.monotonic()
        self.checking = checking
        self.starts.append((checking, time.perf_counter()))

    def on_train_end(self, trainer, pl_module):
        steps = {True: [], False: []}
        for i in range(2 * BLOCK, len(self.starts) - 1):  # the first round warms up; a block's edges are left out
            (before, _), (mode, start), (after, end) = self.starts[i - 1], self.starts[i], self.starts[i + 1]
            if before == mode == after:
                steps[mode].append(end - start)
        if trainer.is_global_zero:
            check, none = statistics.median(steps[True]) * 1000, statistics.median(steps[False]) * 1000
            print(
                f"lightning {pl.__version__}: check {check:.3f} ms/step, no check {none:.3f} ms/step, "
                f"{(check / none - 1) * 100:+.1f}%"
            )


if __name__ == "__main__":
    pl.seed_everything(0)
    steps = 2 * BLOCK * ROUNDS
    data = TensorDataset(torch.randn(4 * steps, 8), torch.randn(4 * steps, 1))
    trainer = pl.Trainer(
        accelerator="cpu",
        strategy="ddp",
        devices=2,
        max_steps=steps,
        callbacks=[Interleave()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Tiny(), DataLoader(data, batch_size=2))
