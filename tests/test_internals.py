"""The canary: every private name of Lightning (and of torch) the package reaches is still there.

Run on every release of the version matrix (make test-versions). A failure names the attribute, what
the package uses it for, and the release: the place to look is ``src/ddp_sigterm/_lightning/internals.py`` (its lists
and accessors; torch's: ``runtime.TORCH_INTERNALS`` and ``torchelastic.AGENT_VARIABLES``).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import os

import pytest
import torch

from ddp_sigterm._core import runtime, torchelastic
from ddp_sigterm._lightning import internals, resume_internals

# distribution -> (its Trainer package, its Fabric package, the package's integration module)
DISTRIBUTIONS = {
    "lightning": ("lightning.pytorch", "lightning.fabric", "ddp_sigterm.lightning_integration"),
    "pytorch_lightning": ("pytorch_lightning", "lightning_fabric", "ddp_sigterm.pytorch_lightning_integration"),
}


def installed(distribution: str) -> None:
    """Skip (visibly) a distribution that is not installed, unless the run requires it (CANARY_DISTRIBUTIONS,
    comma-separated: make test-versions requires both)."""
    if importlib.util.find_spec(distribution) is None:
        required = os.environ.get("CANARY_DISTRIBUTIONS", "").split(",")
        assert distribution not in required, f"{distribution} is not installed in this environment"
        pytest.skip(f"{distribution} is not installed here")


def trainer_of(distribution: str, tmp_path, callbacks=()):
    pl = importlib.import_module(DISTRIBUTIONS[distribution][0])
    return pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                      callbacks=list(callbacks))


@pytest.mark.parametrize("distribution", sorted(DISTRIBUTIONS))
def test_every_lightning_internal_the_package_reaches_is_there(distribution: str, tmp_path) -> None:
    installed(distribution)
    trainer_package, fabric_package, _ = DISTRIBUTIONS[distribution]
    version = importlib.import_module(trainer_package).__version__
    fabric = importlib.import_module(fabric_package).Fabric(accelerator="cpu", devices=1)
    gone = {
        "Trainer": internals.missing(trainer_of(distribution, tmp_path), internals.TRAINER + internals.BEFORE_RUN,
                                     distribution),
        "Fabric": internals.missing(fabric, internals.FABRIC, distribution),
        f"{fabric_package}.strategies.launchers.subprocess_script":
            internals.missing(internals.launchers(fabric_package), internals.LAUNCHER, distribution),
    }
    assert not any(gone.values()), f"{distribution} {version} lacks: " + "; ".join(
        f"{owner}.{path}" for owner, paths in gone.items() for path in paths)


@pytest.mark.parametrize("distribution", sorted(DISTRIBUTIONS))
def test_every_logger_internal_the_package_reaches_is_there(distribution: str, tmp_path, monkeypatch) -> None:
    """The loggers whose runs a resume continues: each of :data:`internals.LOGGERS` whose library is installed here
    (CSV always; ``make test``'s venv has TensorBoard, W&B and MLflow), and the CSV writer's list of columns."""
    installed(distribution)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    loggers = importlib.import_module(f"{DISTRIBUTIONS[distribution][0]}.loggers")
    libraries = {"TensorBoardLogger": ("tensorboard", "tensorboardX"), "WandbLogger": ("wandb",),
                 "MLFlowLogger": ("mlflow",), "CSVLogger": ()}
    checked = []
    for kind, needs in libraries.items():
        if needs and not any(importlib.util.find_spec(name) for name in needs):
            continue
        made = {"WandbLogger": lambda cls: cls(save_dir=str(tmp_path), offline=True),
                "MLFlowLogger": lambda cls: cls(tracking_uri=f"file:{tmp_path}/mlruns")}.get(kind, lambda cls: cls(
                    str(tmp_path)))(getattr(loggers, kind))
        assert resume_internals.logger_kind(made) == kind
        assert not internals.missing(made, internals.LOGGERS[kind], distribution), kind
        checked.append(kind)
    csv_writer = loggers.CSVLogger(str(tmp_path)).experiment
    assert isinstance(csv_writer.metrics_keys, list), "the CSV writer's columns, set where a resume appends"
    assert "CSVLogger" in checked


@pytest.mark.parametrize("distribution", sorted(DISTRIBUTIONS))
def test_the_entry_points_instance_follows_the_trainers_choice_of_checkpoint(distribution: str, tmp_path,
                                                                           monkeypatch) -> None:
    """The instance the entry point adds finds the Trainer being made (in its callers' frames) and follows its
    choice of checkpoint; with ``DDP_SIGTERM=0`` no instance is added and nothing is changed."""
    installed(distribution)
    trainer = trainer_of(distribution, tmp_path)
    assert isinstance(trainer._checkpoint_connector.__dict__.get("_select_ckpt_path"), internals.CheckpointChoice)
    monkeypatch.setenv("DDP_SIGTERM", "0")
    assert "_select_ckpt_path" not in trainer_of(distribution, tmp_path)._checkpoint_connector.__dict__


@pytest.mark.parametrize("distribution", sorted(DISTRIBUTIONS))
def test_the_sampler_wrapper_whose_order_a_resume_deals_is_there(distribution: str) -> None:
    """Lightning wraps a training loader's own sampler (a StatefulDataLoader's ``shuffle=True``: torchdata's
    RandomSampler) in its DistributedSamplerWrapper; the stop records the wrapped sampler's generator."""
    installed(distribution)
    from torchdata.stateful_dataloader.sampler import RandomSampler

    module = importlib.import_module(f"{DISTRIBUTIONS[distribution][1]}.utilities.distributed")
    inner = RandomSampler(range(10))
    wrapper = getattr(module, internals.SAMPLER_WRAPPER)(inner, num_replicas=2, rank=0)
    assert not internals.missing(wrapper, internals.WRAPPED, distribution)
    assert resume_internals.wrapped_sampler(wrapper) is inner
    assert resume_internals.wrapped_sampler(inner) is None
    assert [wrapper.dataset[place] for place in range(10)] == wrapper.dataset._sampler_list, \
        "the wrapper's places index the order it drew from the wrapped sampler"


@pytest.mark.parametrize(("module", "name", "why"), runtime.TORCH_INTERNALS,
                         ids=[name for _, name, _ in runtime.TORCH_INTERNALS])
def test_every_torch_internal_the_package_reaches_is_there(module: str, name: str, why: str) -> None:
    found: object = importlib.import_module(module)
    for part in name.split("."):
        assert hasattr(found, part), f"torch {torch.__version__}: {module}.{name} is gone ({why})"
        found = getattr(found, part)
    assert callable(found), f"{module}.{name} ({why})"


@pytest.mark.parametrize("variable", sorted(torchelastic.AGENT_VARIABLES))
def test_torchruns_agent_still_sets_the_variables_the_restart_warning_reads(variable: str) -> None:
    module = importlib.import_module(torchelastic.AGENT_VARIABLES[variable])
    assert variable in inspect.getsource(module), f"torch {torch.__version__}: {module.__name__} no longer sets it"


@pytest.mark.parametrize("distribution", sorted(DISTRIBUTIONS))
def test_a_missing_internal_switches_the_callback_off_with_a_warning_naming_it(distribution: str, tmp_path,
                                                                                monkeypatch) -> None:
    installed(distribution)
    integration = importlib.import_module(DISTRIBUTIONS[distribution][2])
    trainer = trainer_of(distribution, tmp_path)
    connector = type(trainer._signal_connector)
    monkeypatch.delattr(connector, "_sigterm_notifier_fn")  # as if Lightning had renamed it
    assert internals.missing(trainer, internals.TRAINER, distribution) == [
        "_signal_connector._sigterm_notifier_fn (replaced by the recorder (2.5.2+ broadcasts in the handler))"]
    callback = integration.UnisonStop()
    trainer.callbacks.append(callback)
    monkeypatch.setattr(internals, "_warned", set())
    with pytest.warns(UserWarning, match=r"ddp_sigterm is switched off: .* has no _signal_connector\."
                                         r"_sigterm_notifier_fn"):
        callback.setup(trainer, None, "fit")
    assert callback._coordinator is None  # nothing changed: stock Lightning handles SIGTERM
    assert "_sigterm_notifier_fn" not in trainer._signal_connector.__dict__


@pytest.mark.parametrize("distribution", sorted(DISTRIBUTIONS))
def test_an_untested_release_gets_a_warning(distribution: str, tmp_path, monkeypatch) -> None:
    installed(distribution)
    integration = importlib.import_module(DISTRIBUTIONS[distribution][2])
    monkeypatch.setattr(integration.UnisonStop, "lightning",
                        dataclasses.replace(integration.UnisonStop.lightning, version="2.99.0"))
    monkeypatch.setattr(internals, "_warned", set())
    trainer = trainer_of(distribution, tmp_path)
    callback = integration.UnisonStop()
    trainer.callbacks.append(callback)
    with pytest.warns(UserWarning, match=rf"tested with {distribution} 2\.5\.1 to 2\.6\.6 .*; this is {distribution} "
                                         r"2\.99\.0"):
        callback.setup(trainer, None, "fit")
    try:
        assert callback._coordinator is not None  # it still acts: the names it needs are there
    finally:
        callback.teardown(trainer, None, "fit")


def test_release_ranges() -> None:
    assert internals.untested("lightning", "2.6.6+ddpsigterm") is None  # the patched build's local version
    assert internals.untested("lightning", "2.5.1.post0") is None
    assert internals.untested("lightning", "2.4.0") is not None
    assert internals.untested("pytorch_lightning", "2.7.0") is not None
