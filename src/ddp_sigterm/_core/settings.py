"""Settings: one validated dataclass, overridden by ``DDP_SIGTERM_*`` environment variables.

Precedence, lowest to highest: the field defaults, the arguments given in code, the environment.
The environment wins so that an operator can change a job's behaviour without editing its script.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
from collections.abc import Mapping
from typing import Any

ENV_PREFIX = "DDP_SIGTERM"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class SettingsError(ValueError):
    """A setting or its environment variable has a value that cannot work."""


def signal_number(name: str | int | signal.Signals) -> int:
    """Return the number of a signal given as ``"SIGTERM"``, ``"TERM"``, ``15`` or ``signal.SIGTERM``."""
    if isinstance(name, int):
        try:
            return int(signal.Signals(name))
        except ValueError:
            raise SettingsError(f"{name} is not a signal number on this platform") from None
    text = name.strip().upper()
    if text.isdigit():
        return signal_number(int(text))
    if not text.startswith("SIG"):
        text = "SIG" + text
    try:
        return int(signal.Signals[text])
    except KeyError:
        raise SettingsError(
            f"Unknown signal {name!r}; use a name such as SIGTERM or SIGUSR2"
            f" (check {ENV_PREFIX}_SIGNALS if you set it)"
        ) from None


@dataclasses.dataclass(frozen=True)
class Settings:
    """How the stop is detected and agreed. Every field can be overridden by ``DDP_SIGTERM_<FIELD>``."""

    enabled: bool = True
    """Master switch. ``DDP_SIGTERM=0`` (note: no suffix) turns the package off: stock behaviour."""

    signals: tuple[str, ...] = ("SIGTERM",)
    """Signals that request a stop. Environment: comma-separated names, e.g. ``SIGTERM,SIGUSR2``.
    SIGKILL and SIGSTOP cannot be caught and are rejected."""

    max_delay: float = 1.0
    """Upper bound, in seconds, on the time between the first signal on any rank and the agreed stop,
    for steps shorter than this; a longer step stops at the next step boundary. When steps become
    slower than the cadence was measured on, the heartbeat (every ``max_delay / 2`` seconds) brings the
    stop within ``max_delay / 2`` and two or three steps."""

    check_budget: float = 0.001
    """Fraction of training time the agreement's own duration may take. The cadence stretches the
    interval between agreements until the measured duration fits, never beyond ``max_delay``. A
    collective costs a step more than its own duration (threads waking, the next collective
    disturbed: 2-3 times, measured in docs/benchmarks.md): 0.1% keeps the whole well under 1% (0.3%,
    the default until the heartbeat bounded the stop in time, measured +1.1% at 10 ms steps)."""

    agreement_timeout: float = 600.0
    """Seconds one agreement may wait for the slowest rank before it fails with an error naming the
    rank and step. It bounds skew between ranks, not the step time."""

    connect_timeout: float = 30.0
    """Seconds Gloo may wait for each connection of the package's own groups at the start of a
    multi-process run. If a group cannot be made on every rank (Gloo picked an interface the other
    nodes cannot reach: see docs/multi-node.md), the package warns once and steps aside for the run, on
    every rank: the run goes on as it would without it. Gloo waits for its peers in turn, so a rank
    that nobody reaches gives up after a few times this (5 times with 4 ranks, measured). A run whose
    groups connect never waits for it."""

    save_checkpoint: bool = True
    """Save ``hpc_ckpt_<N>.ckpt`` at an agreed stop during ``fit`` (Lightning integration)."""

    checkpoint_dir: str = ""
    """Where the Trainer's stop checkpoints go: a local directory or an fsspec URL (``s3://bucket/run``).
    Empty (the default): the Trainer's ``default_root_dir``, where Lightning looks for ``ckpt_path="hpc"``."""

    keep_checkpoints: int = 0
    """How many stop checkpoints (``hpc_ckpt_<N>.ckpt``) to keep in that directory: after a stop
    checkpoint is saved, all but the newest ``keep_checkpoints`` are deleted. 0 (the default) keeps all."""

    resume: bool = False
    """Resume ``fit`` from the newest stop checkpoint when it is started without ``ckpt_path``, on every
    platform (Lightning does it by itself only under SLURM, and only from ``default_root_dir``; with a
    ``checkpoint_dir``, the package does it there under SLURM too). Every rank resumes from global rank
    0's choice. Off by default: a script run again in the same directory would otherwise no longer
    start from scratch. Set ``DDP_SIGTERM_RESUME=1`` where a relaunch must resume (a Kubernetes Job,
    torchrun's restarts)."""

    stop_deadline: float = 25.0
    """Seconds from the first stop signal (on a rank that was not signalled: from the agreed stop)
    within which the process of a multi-process run must have exited (a process alone has no peer to
    wait for, and keeps no deadline). Past it the stop is abandoned: the process prints what
    it was waiting for and exits with code 201 at once, even from inside a collective that waits for a
    stopped or dead peer. The default stays under the common 30 s grace period (Kubernetes, SLURM's
    KillWait) that ends in SIGKILL; raise both for saves that take longer. ``inf`` turns it off."""

    destroy_at_exit: bool = True
    """After an agreed stop of a multi-process run, destroy the default (gloo) process group when the
    process exits: a gloo group still alive at interpreter exit sometimes aborts the process
    ("terminate called without an active exception", exit code -6), hiding the stop's exit code. A run
    that gets no signal is left as stock leaves it (the package's own groups are always destroyed)."""

    log_level: str = "INFO"
    """Level of the ``ddp_sigterm`` logger (``DEBUG``, ``INFO``, ``WARNING``, ...). At INFO every rank
    logs a stop: the signal, the rank that received it and when, the agreed step, the checkpoint and
    how long saving it took; a run that gets no signal logs nothing."""

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise SettingsError(f"enabled must be a bool, got {self.enabled!r}")
        given: object = self.signals  # the environment gives "SIGTERM,SIGUSR2"; so may code
        if isinstance(given, str):
            object.__setattr__(self, "signals", tuple(s for s in given.split(",") if s.strip()))
        if not self.signals:
            raise SettingsError("signals must name at least one signal, e.g. SIGTERM")
        numbers = [signal_number(s) for s in self.signals]
        uncatchable = {int(signal.SIGKILL), int(signal.SIGSTOP)} & set(numbers)
        if uncatchable:
            names = ", ".join(signal.Signals(n).name for n in sorted(uncatchable))
            raise SettingsError(f"signals cannot include {names}: they cannot be caught")
        object.__setattr__(self, "signals", tuple(signal.Signals(n).name for n in dict.fromkeys(numbers)))
        for name in ("max_delay", "agreement_timeout", "connect_timeout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise SettingsError(f"{name} must be a positive number of seconds, got {value!r}")
        if not isinstance(self.check_budget, (int, float)) or not 0 < self.check_budget < 1:
            raise SettingsError(f"check_budget must be a fraction between 0 and 1, got {self.check_budget!r}")
        if not isinstance(self.checkpoint_dir, str):
            raise SettingsError(f"checkpoint_dir must be a directory or URL, got {self.checkpoint_dir!r}")
        keep = self.keep_checkpoints
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 0:
            raise SettingsError(f"keep_checkpoints must be a whole number, 0 to keep all, got {keep!r}")
        for name in ("save_checkpoint", "destroy_at_exit", "resume"):
            if not isinstance(getattr(self, name), bool):
                raise SettingsError(f"{name} must be a bool, got {getattr(self, name)!r}")
        level = self.log_level.strip().upper() if isinstance(self.log_level, str) else self.log_level
        if not isinstance(logging.getLevelName(level), int):
            raise SettingsError(f"log_level must be a logging level such as INFO or WARNING, got {self.log_level!r}")
        object.__setattr__(self, "log_level", level)
        deadline = self.stop_deadline
        if not isinstance(deadline, (int, float)) or math.isnan(deadline) or deadline <= 0:
            raise SettingsError(f"stop_deadline must be a positive number of seconds or inf, got {deadline!r}")

    @property
    def signal_numbers(self) -> tuple[int, ...]:
        return tuple(signal_number(s) for s in self.signals)

    @classmethod
    def resolve(cls, environ: Mapping[str, str] | None = None, **given: Any) -> Settings:
        """Build settings from ``given`` (code) overridden by the environment; bad values raise
        :class:`SettingsError` naming the variable."""
        environ = os.environ if environ is None else environ
        values = dict(given)
        for field in dataclasses.fields(cls):
            var = ENV_PREFIX if field.name == "enabled" else f"{ENV_PREFIX}_{field.name.upper()}"
            if var in environ:
                values[field.name] = _parse(var, environ[var], field.type)
        known = {ENV_PREFIX} | {f"{ENV_PREFIX}_{f.name.upper()}" for f in dataclasses.fields(cls)
                                if f.name != "enabled"}
        unknown = sorted(k for k in environ if k.startswith(ENV_PREFIX + "_") and k not in known)
        if unknown:
            raise SettingsError(f"Unknown environment variable(s) {', '.join(unknown)}; "
                                f"known: {', '.join(sorted(known))}")
        return cls(**values)


def _parse(var: str, raw: str, kind: Any) -> Any:
    text = raw.strip()
    if kind in (bool, "bool"):
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise SettingsError(f"{var}={raw!r}: expected one of 1/0, true/false, yes/no, on/off")
    if kind in (int, "int"):
        try:
            return int(text)
        except ValueError:
            raise SettingsError(f"{var}={raw!r}: expected a whole number") from None
    if kind in (float, "float"):
        try:
            return float(text)
        except ValueError:
            raise SettingsError(f"{var}={raw!r}: expected a number") from None
    return text
