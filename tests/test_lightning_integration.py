"""In-process checks of the Lightning integrations (one process, no signal sent from outside): the
Trainer callback for both ``lightning.pytorch`` and the standalone ``pytorch_lightning``, and the
Fabric callback."""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ddp_sigterm import SettingsError
from ddp_sigterm._lightning import internals

# (Trainer package, the package's callback for it)
TRAINER_PACKAGES = {
    "lightning.pytorch": "ddp_sigterm.lightning_integration",
    "pytorch_lightning": "ddp_sigterm.pytorch_lightning_integration",
}


@pytest.fixture(params=sorted(TRAINER_PACKAGES))
def lightning(request) -> SimpleNamespace:
    """One Trainer package: ``pl`` (the package), ``UnisonStop`` (ours for it), ``Tiny`` and ``Probe``."""
    pl = importlib.import_module(request.param)
    ours = importlib.import_module(TRAINER_PACKAGES[request.param])

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def validation_step(self, batch, batch_idx):
            self.log("value", self.layer(batch[0]).sum())

        test_step = validation_step

        def predict_step(self, batch, batch_idx):
            return self.layer(batch[0])

        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2)

        val_dataloader = test_dataloader = predict_dataloader = train_dataloader

    class Probe(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            self.active = [cb for cb in trainer.callbacks
                           if isinstance(cb, ours.UnisonStop) and cb._coordinator is not None]
            self.record = self.active[0]._coordinator.integration.record if self.active else None
            self.notifier = trainer._signal_connector.__dict__.get("_sigterm_notifier_fn")
            self.broadcast = trainer.fit_loop.epoch_loop.__dict__.get("_broadcast_sigterm_tensor")
            self.handler = signal.getsignal(signal.SIGTERM)

    return SimpleNamespace(pl=pl, UnisonStop=ours.UnisonStop, Tiny=Tiny, Probe=Probe)


def trainer_with(lightning: SimpleNamespace, *callbacks, tmp_path):
    return lightning.pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                                callbacks=list(callbacks))


def test_explicit_callback_wins_and_lightning_hooks_are_restored(lightning, tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("DDP_SIGTERM", raising=False)
    explicit, probe = lightning.UnisonStop(max_delay=0.5), lightning.Probe()
    trainer = trainer_with(lightning, explicit, probe, tmp_path=tmp_path)
    auto = [cb for cb in trainer.callbacks if isinstance(cb, lightning.UnisonStop) and cb.auto_registered]
    assert len(auto) == 1, "the entry point did not register the callback"
    before = signal.getsignal(signal.SIGTERM)
    trainer.fit(lightning.Tiny())
    assert probe.active == [explicit]  # the auto-registered instance stepped aside
    assert explicit.settings.max_delay == 0.5
    # Lightning's notifier (a broadcast in the handler from 2.5.2) is the recorder of the run's coordinator
    assert probe.notifier == probe.record
    # Lightning's per-batch broadcast (from 2.5.2) is switched off
    if internals.at_least(explicit.lightning.distribution, "2.5.2"):
        assert probe.broadcast is internals._no_broadcast
    assert probe.handler is not before
    # after the run: Lightning's own methods are back, the handler is the user's again
    assert "_sigterm_notifier_fn" not in trainer._signal_connector.__dict__
    assert "_broadcast_sigterm_tensor" not in trainer.fit_loop.epoch_loop.__dict__
    assert signal.getsignal(signal.SIGTERM) == before


@pytest.fixture
def exit_functions(monkeypatch) -> list:
    """The functions registered with ``atexit`` from here on and not unregistered (atexit cannot list them)."""
    live: list = []
    register, unregister = atexit.register, atexit.unregister

    def tracked_register(func, *args, **kwargs):
        live.append(func)
        return register(func, *args, **kwargs)

    def tracked_unregister(func) -> None:
        live[:] = [f for f in live if f != func]
        unregister(func)

    monkeypatch.setattr(atexit, "register", tracked_register)
    monkeypatch.setattr(atexit, "unregister", tracked_unregister)
    return live


def _process_state(exit_functions: list) -> dict:
    """What a run could leave behind in this process: threads, signal handlers, the wakeup fd, exit functions."""
    gc.collect()  # a DataLoader's queue threads end, soon after its iterator is collected
    deadline = time.monotonic() + 10
    while any(t.name == "QueueFeederThread" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    wakeup = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup)
    handlers = {signum: signal.getsignal(signum) for signum in signal.valid_signals()
                if signum not in (signal.SIGKILL, signal.SIGSTOP)}
    return {"threads": sorted((t.name, t.ident) for t in threading.enumerate()), "handlers": handlers,
            "wakeup_fd": wakeup, "exit_functions": list(exit_functions)}


def test_nothing_of_the_package_outlives_a_run(lightning, tmp_path, monkeypatch, exit_functions) -> None:
    """fit, validate, test and predict back to back in one process, with every stop signal the
    settings accept listed: after each, the process is as it was before (Lightning's own test suite
    fails a test that leaves a thread behind)."""
    monkeypatch.setenv("DDP_SIGTERM", "0")  # first stock Lightning: whatever it leaves is not ours

    class WithWorkers(lightning.Tiny):
        def val_dataloader(self):  # a worker process: the package's at-fork and at-exit actions get used
            return DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2, num_workers=1)

        test_dataloader = predict_dataloader = val_dataloader

    model = WithWorkers()
    stock = trainer_with(lightning, tmp_path=tmp_path)
    for method in (stock.fit, stock.validate, stock.test, stock.predict):
        method(model)
    del stock, method  # with its DataLoaders and their threads
    before = _process_state(exit_functions)
    monkeypatch.setenv("DDP_SIGTERM", "1")
    monkeypatch.setenv("DDP_SIGTERM_SIGNALS", "SIGTERM,SIGINT,SIGUSR1,SIGUSR2")
    probe = lightning.Probe()
    trainer = trainer_with(lightning, probe, tmp_path=tmp_path)
    assert [cb for cb in trainer.callbacks if isinstance(cb, lightning.UnisonStop)], "the package is not active"
    for name in ("fit", "validate", "test", "predict"):
        getattr(trainer, name)(model)
        assert _process_state(exit_functions) == before, f"{name} left something behind"
    assert probe.notifier is not None, "the package never handled SIGTERM"


def test_opt_out_registers_nothing(lightning, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DDP_SIGTERM", "0")
    trainer = trainer_with(lightning, tmp_path=tmp_path)
    assert not [cb for cb in trainer.callbacks if isinstance(cb, lightning.UnisonStop)]


def test_bad_environment_fails_when_the_trainer_is_built(lightning, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DDP_SIGTERM_MAX_DELAY", "0")
    with pytest.raises(SettingsError, match="max_delay must be a positive number"):
        trainer_with(lightning, tmp_path=tmp_path)


def test_a_misspelt_variable_only_warns_where_the_package_does_not_act(lightning, tmp_path, monkeypatch) -> None:
    """A one-device Trainer, which the package never acts on, trains with a typo'd DDP_SIGTERM_* variable
    in the environment and is told about it; a multi-process run fails before training
    (tests/test_faults.py::test_bad_settings_stop_the_job_before_training_with_the_reason)."""
    monkeypatch.setenv("DDP_SIGTERM_STOP_DEADLIN", "600")
    with pytest.warns(UserWarning, match=r"Unknown environment variable\(s\) DDP_SIGTERM_STOP_DEADLIN; known: "):
        trainer = trainer_with(lightning, tmp_path=tmp_path)
    trainer.fit(lightning.Tiny())
    assert trainer.global_step == 2


# -- Fabric ----------------------------------------------------------------------------------------
@pytest.fixture(params=["lightning.fabric", "lightning_fabric"])
def fabric_package(request):
    return importlib.import_module(request.param)


def test_fabric_loop_gets_one_coordinator_that_records_sigterm(fabric_package, monkeypatch) -> None:
    from ddp_sigterm.fabric import FabricStop, unison_stop

    monkeypatch.delenv("DDP_SIGTERM", raising=False)
    before = signal.getsignal(signal.SIGTERM)
    fabric = fabric_package.Fabric(accelerator="cpu", devices=1)
    assert [type(cb) for cb in fabric._callbacks] == [FabricStop], "the entry point did not register FabricStop"
    assert signal.getsignal(signal.SIGTERM) == before, "registering must not touch the handlers"
    fabric.launch()
    stop = unison_stop(fabric)
    assert unison_stop(fabric) is stop
    assert not stop.should_stop(1)
    os.kill(os.getpid(), signal.SIGTERM)  # recorded, not fatal
    try:
        assert stop.should_stop(2)
        assert (stop.exit_code, stop.decision.step) == (143, 2)
    finally:
        stop.close()
    # one process: after the stop, nothing of the package is left (a multi-process stop ignores later signals)
    assert signal.getsignal(signal.SIGTERM) == before


def test_fabric_explicit_settings_win_and_opt_out_is_inert(fabric_package, monkeypatch) -> None:
    from ddp_sigterm.fabric import FabricStop, unison_stop

    monkeypatch.delenv("DDP_SIGTERM", raising=False)
    explicit = FabricStop(max_delay=0.5)
    fabric = fabric_package.Fabric(accelerator="cpu", devices=1, callbacks=[explicit])
    stop = unison_stop(fabric)
    try:
        assert explicit.coordinator is stop
        assert stop.integration.settings.max_delay == 0.5
    finally:
        stop.close()

    monkeypatch.setenv("DDP_SIGTERM", "0")
    before = signal.getsignal(signal.SIGTERM)
    fabric = fabric_package.Fabric(accelerator="cpu", devices=1)
    assert not [cb for cb in fabric._callbacks if isinstance(cb, FabricStop)]
    stop = unison_stop(fabric)
    assert signal.getsignal(signal.SIGTERM) == before  # no handler: SIGTERM ends the script as before
    assert not stop.should_stop(1)
    assert not stop.decide_now(1)
    stop.close()


# -- Lightning's launcher ----------------------------------------------------------------------------
@pytest.mark.parametrize("retired", [False, True])
def test_agreed_stop_retires_the_launchers_child_watch(fabric_package, retired: bool) -> None:
    """Lightning's launcher watches the ranks it started and SIGKILLs every rank, its own process
    included, once one exits non-zero. After an agreed stop every rank exits 143 on its own, so the
    watch must stand down. A stand-in 'main' process takes the SIGKILL the real one would get."""
    import subprocess

    from ddp_sigterm._lightning.internals import retire_child_watch

    launchers = importlib.import_module(f"{fabric_package.__name__}.strategies.launchers.subprocess_script")
    main = subprocess.Popen(["sleep", "60"], start_new_session=True)
    child = subprocess.Popen(["sh", "-c", "sleep 0.5; exit 143"], start_new_session=True)
    try:
        watch = launchers._ChildProcessObserver(main_pid=main.pid, child_processes=[child], sleep_period=0.1)
        watch.start()
        if retired:
            retire_child_watch()  # at the agreed stop, while every rank is still alive
        child.wait(timeout=30)
        watch.join(timeout=30)
        assert not watch.is_alive()
        with contextlib.suppress(subprocess.TimeoutExpired):
            main.wait(timeout=2)  # a SIGKILL sent by the watch has landed by then
        main_survived = main.returncode is None
        assert main_survived == retired, "the watch SIGKILLed the launcher's process" if retired else "control: no kill"
    finally:
        for proc in (main, child):
            proc.kill()
            proc.wait(timeout=30)


def test_the_other_packages_trainer_is_refused_by_name(lightning, tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("DDP_SIGTERM", raising=False)
    other = next(module for package, module in TRAINER_PACKAGES.items() if package != lightning.pl.__name__)
    wrong = importlib.import_module(other).UnisonStop()
    trainer = trainer_with(lightning, wrong, tmp_path=tmp_path)
    with pytest.raises(TypeError, match="is for .* Trainer, not .*: use the UnisonStop of"):
        trainer.fit(lightning.Tiny())
