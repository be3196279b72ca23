"""The loggers' runs across a stop, so that one training is one TensorBoard or CSV version, W&B or MLflow run."""

from __future__ import annotations

from typing import Any

import torch
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from ddp_sigterm._lightning import internals, stop_checkpoints
from ddp_sigterm._lightning.resume_internals import give_logger_run, logger_kind, logger_made, logger_run

Runs = list[dict[str, Any] | None]


def record(loggers: list[Any], distribution: str) -> Runs:
    """Per logger ``{"logger": <class>, "run": <run>}``, or None where its run is not carried."""
    runs: Runs = []
    for logger in loggers:
        kind = logger_kind(logger)
        run = None if kind is None or _unreachable(logger, kind, distribution) else logger_run(logger, kind)
        runs.append(None if run is None else {"logger": kind, "run": run})
    return runs


def recorded(path: str) -> Runs:
    """The runs recorded in the stop checkpoint at ``path``, read without its tensors (memory-mapped if local)."""
    fs, where = url_to_fs(path)
    if fs.isdir(where):  # a sharded checkpoint (FSDP's): its part that is not tensors
        where = f"{where.rstrip('/')}/meta.pt"
    if isinstance(fs, LocalFileSystem):
        checkpoint = torch.load(where, map_location="cpu", mmap=True, weights_only=False)
    else:
        with fs.open(where, "rb") as file:
            checkpoint = torch.load(file, map_location="cpu", weights_only=False)
    runs: Runs = checkpoint.get(stop_checkpoints.KEY, {}).get("logger_runs", [])
    return runs


def give_back(loggers: list[Any], runs: Runs, distribution: str) -> tuple[list[str], list[str]]:
    """Give each logger its recorded run unless it has another; returns what was given and the warnings."""
    given, kept = [], []
    for logger, saved in zip(loggers, runs):
        kind = logger_kind(logger)
        if saved is None or kind is None or kind != saved["logger"] or _unreachable(logger, kind, distribution):
            continue
        current, run = logger_run(logger, kind), saved["run"]
        name = "version" if kind in ("TensorBoardLogger", "CSVLogger") else "run"
        if current is None or (current == run and not logger_made(logger, kind)):
            give_logger_run(logger, kind, run)  # (the stop's own version given in code: the CSV's rows)
            given.append(f"{kind} {name} {run}")
        elif current != run:
            kept.append(f"ddp_sigterm: the {kind} is given {name} {current} before the fit: the fit resumed from a "
                        f"stop keeps it, and its curves start again there, not in the stop's {name} {run}. Leave the "
                        f"{name} unset, and make no run before the fit, to continue the stop's run "
                        "(DDP_SIGTERM_RESUME_LOGGER_RUNS=0 turns this off)")
    return given, kept


def _unreachable(logger: Any, kind: str, distribution: str) -> bool:
    gone = internals.missing(logger, internals.LOGGERS[kind], distribution)
    if gone:
        internals.warn_once(f"ddp_sigterm: the {kind}'s run is not carried across a stop: it has no "
                            f"{'; no '.join(gone)}")
    return bool(gone)
