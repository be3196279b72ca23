"""The loggers' runs across a stop (ddp_sigterm._lightning.logger_runs), with Lightning's real logger objects: what
the stop checkpoint records of each, and what a resume gives back to which. The end-to-end runs are in
tests/test_logger_runs.py."""

from __future__ import annotations

import csv
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
from lightning.pytorch.loggers import CSVLogger, Logger, MLFlowLogger, TensorBoardLogger, WandbLogger

from ddp_sigterm._lightning import logger_runs, stop_checkpoints


@pytest.fixture(autouse=True)
def mlflow_file_store(monkeypatch) -> None:
    """MLflow 3 refuses a file store unless told (its client is made with the logger)."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")


class OwnLogger(Logger):
    """A logger of the user's: not carried."""

    name = "own"
    version = 3

    def log_metrics(self, metrics, step=None) -> None: ...

    def log_hyperparams(self, params, *args, **kwargs) -> None: ...


def test_the_stop_records_each_carried_loggers_run_and_none_for_the_rest(tmp_path: Path) -> None:
    tensorboard, unresolved = TensorBoardLogger(tmp_path, name="tb"), CSVLogger(tmp_path, name="csv")
    assert tensorboard.version == 0  # resolved, as a fit does when it makes the run
    wandb = WandbLogger(save_dir=str(tmp_path), offline=True, id="abc123")
    mlflow = MLFlowLogger(tracking_uri=f"file:{tmp_path}/mlruns", run_id="f00d")
    assert logger_runs.record([tensorboard, unresolved, wandb, mlflow, OwnLogger()], "lightning") == [
        {"logger": "TensorBoardLogger", "run": 0}, None, {"logger": "WandbLogger", "run": "abc123"},
        {"logger": "MLFlowLogger", "run": "f00d"}, None]


def test_a_resume_gives_each_logger_its_run_where_none_is_fixed_yet(tmp_path: Path) -> None:
    tensorboard, wandb = TensorBoardLogger(tmp_path, name="tb"), WandbLogger(save_dir=str(tmp_path), offline=True)
    mlflow = MLFlowLogger(tracking_uri=f"file:{tmp_path}/mlruns")
    (tmp_path / "tb" / "version_0").mkdir(parents=True)  # Lightning's own choice would now be version_1
    runs = [{"logger": "TensorBoardLogger", "run": 0}, {"logger": "WandbLogger", "run": "abc123"},
            {"logger": "MLFlowLogger", "run": "f00d"}]
    given, kept = logger_runs.give_back([tensorboard, wandb, mlflow], runs, "lightning")
    assert given == ["TensorBoardLogger version 0", "WandbLogger run abc123", "MLFlowLogger run f00d"]
    assert not kept
    assert tensorboard.version == 0
    assert tensorboard.log_dir == str(tmp_path / "tb" / "version_0")
    assert wandb.version == "abc123"
    assert wandb._wandb_init["id"] == "abc123"
    assert wandb._wandb_init["resume"] == "allow"
    assert mlflow._run_id == "f00d"


def test_a_logger_whose_run_is_fixed_before_the_fit_keeps_it_with_a_warning(tmp_path: Path) -> None:
    """Given a version of its own, or resolved before the fit: kept, with a warning saying where its curves go;
    given the stop's own version, no warning (and a CSV logger keeps the stop's rows); a logger of another class at
    that place is not touched."""
    given_one, same = TensorBoardLogger(tmp_path, name="tb", version=5), CSVLogger(tmp_path, name="csv", version=0)
    other_class = CSVLogger(tmp_path, name="other")
    runs = [{"logger": "TensorBoardLogger", "run": 0}, {"logger": "CSVLogger", "run": 0},
            {"logger": "TensorBoardLogger", "run": 2}]
    given, kept = logger_runs.give_back([given_one, same, other_class], runs, "lightning")
    assert given == ["CSVLogger version 0"]
    assert other_class._version is None
    assert given_one.version == 5
    (warning,) = kept
    assert "the TensorBoardLogger is given version 5 before the fit" in warning
    assert "not in the stop's version 0" in warning


def test_a_csv_logger_appends_to_the_stops_metrics_csv(tmp_path: Path) -> None:
    """Lightning's CSV writer deletes the ``metrics.csv`` of a folder it finds not empty: given the stop's version,
    it keeps the stop's rows, appends the resume's under the same header, and does not warn that it deletes."""
    folder = tmp_path / "csv" / "version_0"
    folder.mkdir(parents=True)
    (folder / "metrics.csv").write_text("epoch,step,train_loss\n0,0,1.5\n0,1,1.25\n")
    (folder / "hparams.yaml").write_text("{}\n")
    resumed = CSVLogger(tmp_path, name="csv")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        given, _ = logger_runs.give_back([resumed], [{"logger": "CSVLogger", "run": 0}], "lightning")
    assert given == ["CSVLogger version 0"]
    resumed.log_metrics({"train_loss": 1.0, "epoch": 0}, step=2)
    resumed.save()
    with open(folder / "metrics.csv", newline="") as file:
        rows = list(csv.reader(file))
    assert rows == [["epoch", "step", "train_loss"], ["0", "0", "1.5"], ["0", "1", "1.25"], ["0", "2", "1.0"]]


def test_a_checkpoint_without_runs_gives_nothing_back(tmp_path: Path) -> None:
    import torch

    torch.save({"state_dict": {}}, tmp_path / "hpc_ckpt_1.ckpt")
    assert logger_runs.recorded(str(tmp_path / "hpc_ckpt_1.ckpt")) == []
    torch.save({stop_checkpoints.KEY: {"logger_runs": [None, {"logger": "CSVLogger", "run": 4}]}},
               tmp_path / "hpc_ckpt_2.ckpt")
    assert logger_runs.recorded(str(tmp_path / "hpc_ckpt_2.ckpt")) == [None, {"logger": "CSVLogger", "run": 4}]
    sharded = tmp_path / "hpc_ckpt_3.ckpt"  # FSDP's sharded checkpoint: a folder, what is not tensors in meta.pt
    sharded.mkdir()
    torch.save({stop_checkpoints.KEY: {"logger_runs": [{"logger": "CSVLogger", "run": 5}]}}, sharded / "meta.pt")
    assert logger_runs.recorded(str(sharded)) == [{"logger": "CSVLogger", "run": 5}]


def test_a_wandb_logger_takes_a_run_the_script_made_and_keeps_it(tmp_path: Path, monkeypatch) -> None:
    """Lightning's WandbLogger takes ``wandb.run`` if the script made one (``wandb.init`` before the fit): that is
    the run it writes to, whatever id it was given, so it is kept, with the warning."""
    import wandb

    logger = WandbLogger(save_dir=str(tmp_path), offline=True)
    monkeypatch.setattr(wandb, "run", SimpleNamespace(id="made0by0script"))  # as wandb.init() leaves it
    given, kept = logger_runs.give_back([logger], [{"logger": "WandbLogger", "run": "abc123"}], "lightning")
    assert not given
    (warning,) = kept
    assert "the WandbLogger is given run made0by0script before the fit" in warning


@pytest.mark.parametrize("name", ["TensorBoardLogger", "CSVLogger"])
def test_a_subclass_of_a_carried_logger_is_carried(tmp_path: Path, name: str) -> None:
    base = {"TensorBoardLogger": TensorBoardLogger, "CSVLogger": CSVLogger}[name]
    subclass = type("Mine", (base,), {})
    assert logger_runs.record([subclass(tmp_path, version=7)], "lightning") == [{"logger": name, "run": 7}]
