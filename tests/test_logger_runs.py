"""Issue 38: a fit resumed from a stop continues each logger's run: one TensorBoard and one CSV version (one
``metrics.csv``), one W&B run, one MLflow run, one ModelCheckpoint folder, with steps that only increase. Real
two-rank Trainer jobs (tests/support/scenario_train.py) with the real libraries: TensorBoard's event files, W&B in
offline mode, MLflow's file store; the stop is a SIGTERM to rank 1."""

from __future__ import annotations

import csv
from dataclasses import replace
from pathlib import Path

import pytest
from ddp_sigterm_tests import wandb_records
from ddp_sigterm_tests.harness import JobResult
from ddp_sigterm_tests.helpers import assert_finished, assert_unison_stop, fit
from ddp_sigterm_tests.scenario import Scenario

pytestmark = pytest.mark.scenario

ALL = Scenario(loggers=("tensorboard", "csv", "wandb", "mlflow"), batches=10, max_steps=40)
SHORT = replace(ALL, loggers=("tensorboard", "csv"), max_steps=20)
STOP = "1:15:forward"  # rank 1 in its 15th batch; agreed within 0.2 s (10 steps): in the second or third epoch


def environment(tmp_path: Path, **more: str) -> dict[str, str]:
    """The jobs' environment: the stop agreed soon after the signal; W&B's and MLflow's files kept in the test's
    folder (W&B writes its settings and cache under the home folder otherwise; MLflow 3 refuses a file store
    unless told)."""
    wandb = tmp_path / "wandb-home"
    return {"DDP_SIGTERM_MAX_DELAY": "0.2", "MLFLOW_ALLOW_FILE_STORE": "true", "WANDB_SILENT": "true",
            "WANDB_CONFIG_DIR": str(wandb), "WANDB_CACHE_DIR": str(wandb), "WANDB_DATA_DIR": str(wandb), **more}


def tensorboard_steps(version: Path, tag: str = "train_loss") -> list[list[int]]:
    """The steps of ``tag`` in each event file of a TensorBoard version folder, oldest file first."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    files = sorted(version.glob("events.out.tfevents.*"), key=lambda path: int(path.name.split(".")[3]))
    return [[event.step for event in EventFileLoader(str(path)).Load()
             for value in event.summary.value if value.tag == tag] for path in files]


def csv_steps(version: Path, column: str = "train_loss") -> list[int]:
    with open(version / "metrics.csv", newline="") as file:
        return [int(row["step"]) for row in csv.DictReader(file) if row.get(column)]


def wandb_runs(logs: Path) -> list[tuple[str, list[int]]]:
    """Each offline W&B run (a folder per ``wandb.init``, oldest first): its id and the steps it logged."""
    files = sorted((logs / "wandb").glob("offline-run-*/run-*.wandb"))
    return [(wandb_records.run_id(path), [row["trainer/global_step"] for row in wandb_records.history(path)
                                          if "train_loss" in row]) for path in files]


def mlflow_runs(mlruns: Path) -> dict[str, list[int]]:
    """Each MLflow run of the scenario's experiment: its id and the steps of its ``train_loss``."""
    runs = {}
    for meta in mlruns.glob("*/*/meta.yaml"):
        metric = meta.parent / "metrics" / "train_loss"
        runs[meta.parent.name] = [int(line.split()[2]) for line in metric.read_text().splitlines()] \
            if metric.exists() else []
    return runs


def folders(path: Path) -> list[str]:
    return sorted(entry.name for entry in path.iterdir() if entry.is_dir())


def increasing(steps: list[int]) -> bool:
    return all(a < b for a, b in zip(steps, steps[1:]))


def assert_continued(before: list[int], after: list[int], step: int, last: int, why: str) -> None:
    """The steps a run logged before the stop, and those its resume logged: the resume starts at the stop's step and
    goes on to the last, in order."""
    assert before, why
    assert before[-1] < step <= after[0], (before, after, why)
    assert after[-1] == last, (after, why)
    assert increasing(before + after), (before, after, why)


def stop_and_resume(tmp_path: Path, scenario: Scenario, env: dict[str, str], resume: dict[str, str] | None = None
                    ) -> tuple[int, JobResult]:
    """The scenario stopped by SIGTERM to rank 1, then resumed by the same command (``resume``: by
    ``DDP_SIGTERM_RESUME=1`` and no ``ckpt_path``; else ``ckpt_path="hpc"``); returns the stop's step and the resume."""
    stopped = fit(tmp_path / "run", replace(scenario, inject=STOP), env=env)
    step = assert_unison_stop(stopped)
    resumed = fit(tmp_path / "run", replace(scenario, resume=resume is None), env={**env, **(resume or {})})
    assert_finished(resumed, steps=scenario.max_steps)
    return step, resumed


@pytest.mark.parametrize("route", ["hpc", pytest.param("resume", marks=pytest.mark.extended)])
def test_a_resumed_fit_continues_every_loggers_run(tmp_path: Path, route: str) -> None:
    """TensorBoard, CSV, W&B and MLflow loggers, stopped and resumed (``ckpt_path="hpc"``, or the package's
    ``DDP_SIGTERM_RESUME=1``): one version or run each, holding the steps before the stop and after it, in order;
    the ModelCheckpoint's folder (the first logger's version) is one too."""
    env = environment(tmp_path)
    step, resumed = stop_and_resume(tmp_path, ALL, env, {"DDP_SIGTERM_RESUME": "1"} if route == "resume" else None)
    why, logs, last = resumed.describe(), tmp_path / "run" / "logs", ALL.max_steps - 1
    assert folders(logs / "tb") == ["version_0"], why
    assert folders(logs / "tb" / "version_0") == ["checkpoints"], why  # ModelCheckpoint's, in the same version
    before, after = tensorboard_steps(logs / "tb" / "version_0")  # an event file per run, in one version
    assert_continued(before, after, step, last, why)
    assert folders(logs / "csv") == ["version_0"], why
    steps = csv_steps(logs / "csv" / "version_0")  # one metrics.csv: the stop's rows, then the resume's
    # (the step that the stop ended, step - 1, is logged after the callbacks' hook that stops: in no run)
    assert_continued([s for s in steps if s < step], [s for s in steps if s >= step], step, last, why)
    assert steps[0] == 0, why
    assert step - 2 in steps, why
    (first, before), (second, after) = wandb_runs(logs)  # an offline folder per wandb.init, one run id
    assert first == second, why
    assert_continued(before, after, step, last, why)
    runs = mlflow_runs(tmp_path / "run" / "mlruns")
    assert len(runs) == 1, (runs, why)
    (run_id, steps), = runs.items()
    assert_continued([s for s in steps if s < step], [s for s in steps if s >= step], step, last, why)
    said = f"the loggers continue the stop's runs: TensorBoardLogger version 0, CSVLogger version 0, " \
           f"WandbLogger run {first}, MLFlowLogger run {run_id}"
    assert said in resumed.log("rank0"), why
    assert said not in resumed.log("rank1"), why


def test_runs_without_a_stop_make_the_versions_stock_lightning_makes(tmp_path: Path) -> None:
    """What is not a resume from a stop is left to Lightning: two runs in the same folder make the TensorBoard and CSV
    versions stock Lightning makes, ``version_0`` then ``version_1``."""
    env = environment(tmp_path)
    for _ in range(2):
        assert_finished(fit(tmp_path, SHORT, env=env), steps=SHORT.max_steps)
    for logger in ("tb", "csv"):
        assert folders(tmp_path / "logs" / logger) == ["version_0", "version_1"]


@pytest.mark.extended
def test_a_run_after_a_stop_that_does_not_resume_or_with_the_setting_off_makes_new_runs(tmp_path: Path) -> None:
    """A run after a stop that does not resume (no ``ckpt_path``, no ``DDP_SIGTERM_RESUME``), and a resume with
    ``DDP_SIGTERM_RESUME_LOGGER_RUNS=0``, each make a new version, as stock Lightning does."""
    env = environment(tmp_path)
    assert_unison_stop(fit(tmp_path, replace(SHORT, inject="1:5:forward"), env=env))
    afresh = fit(tmp_path, SHORT, env=env)
    assert_finished(afresh, steps=SHORT.max_steps)
    off = fit(tmp_path, replace(SHORT, resume=True), env={**env, "DDP_SIGTERM_RESUME_LOGGER_RUNS": "0"})
    assert_finished(off, steps=SHORT.max_steps)
    assert "the loggers continue" not in afresh.log("rank0") + off.log("rank0")
    for logger in ("tb", "csv"):
        assert folders(tmp_path / "logs" / logger) == ["version_0", "version_1", "version_2"]
