"""In-process checks of the Lightning integration (one process, no signal sent)."""

from __future__ import annotations

import signal

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ddp_sigterm import SettingsError, UnisonStop


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2)


class Probe(pl.Callback):
    def on_train_start(self, trainer, pl_module):
        self.active = [cb for cb in trainer.callbacks if isinstance(cb, UnisonStop) and cb._coordinator is not None]
        self.notifier = trainer._signal_connector.__dict__.get("_sigterm_notifier_fn")
        self.broadcast = trainer.fit_loop.epoch_loop.__dict__.get("_broadcast_sigterm_tensor")
        self.handler = signal.getsignal(signal.SIGTERM)


def trainer_with(*callbacks: pl.Callback, tmp_path) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                      callbacks=list(callbacks))


def test_explicit_callback_wins_and_lightning_hooks_are_restored(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("DDP_SIGTERM", raising=False)
    explicit, probe = UnisonStop(max_delay=0.5), Probe()
    trainer = trainer_with(explicit, probe, tmp_path=tmp_path)
    auto = [cb for cb in trainer.callbacks if isinstance(cb, UnisonStop) and cb.auto_registered]
    assert len(auto) == 1, "the entry point did not register the callback"
    before = signal.getsignal(signal.SIGTERM)
    trainer.fit(Tiny())
    assert probe.active == [explicit]  # the auto-registered instance stepped aside
    assert explicit.settings.max_delay == 0.5
    assert probe.notifier is not None  # Lightning's notifier (broadcast in the handler) replaced
    if hasattr(type(trainer.fit_loop.epoch_loop), "_broadcast_sigterm_tensor"):
        assert probe.broadcast is not None  # Lightning's per-batch broadcast switched off
    assert probe.handler is not before
    # after the run: Lightning's own methods are back, the handler is the user's again
    assert "_sigterm_notifier_fn" not in trainer._signal_connector.__dict__
    assert "_broadcast_sigterm_tensor" not in trainer.fit_loop.epoch_loop.__dict__
    assert signal.getsignal(signal.SIGTERM) == before


def test_opt_out_registers_nothing(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DDP_SIGTERM", "0")
    trainer = trainer_with(tmp_path=tmp_path)
    assert not [cb for cb in trainer.callbacks if isinstance(cb, UnisonStop)]


def test_bad_environment_fails_when_the_trainer_is_built(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DDP_SIGTERM_MAX_DELAY", "0")
    with pytest.raises(SettingsError, match="max_delay must be a positive number"):
        trainer_with(tmp_path=tmp_path)
