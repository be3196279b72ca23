"""Settings: validated dataclasses, overridden by ``DDP_SIGTERM_<FIELD>`` environment variables.

Precedence, lowest to highest: field defaults, arguments in code, the environment (docs/configuration.md).
Here: the machinery and the core's :class:`Settings`; also read so are ``notices.NoticeSettings`` and
``_lightning.settings.TrainerSettings``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import warnings
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")
ENV_PREFIX = "DDP_SIGTERM"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class SettingsError(ValueError):
    """A setting or its environment variable has a value that cannot work."""


def signal_number(name: str | int | signal.Signals) -> int:
    """The number of a signal given as ``"SIGTERM"``, ``"TERM"``, ``15`` or ``signal.SIGTERM``."""
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


_SETTINGS: list[type[Any]] = []  # every settings dataclass read from DDP_SIGTERM_<FIELD>


def read_from_environment(cls: type[T]) -> type[T]:
    """Class decorator: the dataclass's ``DDP_SIGTERM_<FIELD>`` variables are known to the check for misspelt ones."""
    _SETTINGS.append(cls)
    return cls


def resolve(cls: type[T], environ: Mapping[str, str] | None = None, **given: Any) -> T:
    """``cls`` from ``given`` (code) overridden by the environment; a bad value raises :class:`SettingsError`."""
    environ = os.environ if environ is None else environ
    values = dict(given)
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        var = _variable(field.name)
        if var in environ:
            values[field.name] = _parse(var, environ[var], field.type)
    return cls(**values)


def check_bools(settings: object, *names: str) -> None:
    for name in names:
        if not isinstance(getattr(settings, name), bool):
            raise SettingsError(f"{name} must be a bool, got {getattr(settings, name)!r}")


def check_seconds(settings: object, *names: str) -> None:
    for name in names:
        value = getattr(settings, name)
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise SettingsError(f"{name} must be a positive number of seconds, got {value!r}")


@read_from_environment
@dataclasses.dataclass(frozen=True)
class Settings:
    """How the stop is detected and agreed; every field can be overridden by ``DDP_SIGTERM_<FIELD>``."""

    enabled: bool = True
    """Master switch. ``DDP_SIGTERM=0`` (no suffix) turns the package off: stock behaviour."""

    signals: tuple[str, ...] = ("SIGTERM",)
    """Signals that request a stop; environment: comma-separated, e.g. ``SIGTERM,SIGUSR2``. Not SIGKILL/SIGSTOP."""

    max_delay: float = 1.0
    """Seconds: a stop is agreed within ``max_delay / 2`` plus one step of the first signal on any rank, so
    within ``max(max_delay, 2 steps)``; the heartbeat runs every ``max_delay / 2``."""

    agreement_timeout: float = 600.0
    """Seconds one agreement may wait for the slowest rank (skew, not step time) before it fails, naming both."""

    connect_timeout: float = 30.0
    """Seconds Gloo may wait for each connection of the package's own groups at start-up; if one cannot be made
    on every rank, the package warns once and steps aside for the run (docs/multi-node.md)."""

    stop_deadline: float = 25.0
    """Seconds from the first stop signal (or the agreed stop) within which a multi-process run's process must
    have exited; past it, it says what it waited for and exits 201 at once. Under the common 30 s grace
    period; ``inf`` turns it off."""

    destroy_at_exit: bool = True
    """After an agreed stop of a multi-process run, destroy the default gloo group at exit: one still alive
    sometimes aborts the process (-6), hiding the stop's exit code."""

    log_level: str = "INFO"
    """Level of the ``ddp_sigterm`` logger. At INFO every rank logs a stop, and a run without one nothing."""

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
        check_seconds(self, "max_delay", "agreement_timeout", "connect_timeout")
        check_bools(self, "destroy_at_exit")
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
        """:func:`resolve`; an unknown ``DDP_SIGTERM_*`` variable is only a warning here, since a process the
        package never acts on must not fail for it (:meth:`check_environment` makes it an error)."""
        environ = os.environ if environ is None else environ
        unknown = _unknown_variables(environ)
        if unknown:
            warnings.warn(unknown, stacklevel=2)
        return resolve(cls, environ, **given)

    @staticmethod
    def check_environment(environ: Mapping[str, str] | None = None) -> None:
        """Raise :class:`SettingsError` for a ``DDP_SIGTERM_*`` variable no setting has (a typo would silently
        leave a default in force): called where the package is about to act on a multi-process run."""
        unknown = _unknown_variables(os.environ if environ is None else environ)
        if unknown:
            raise SettingsError(unknown)


def _variable(field: str) -> str:
    return ENV_PREFIX if field == "enabled" else f"{ENV_PREFIX}_{field.upper()}"


def _unknown_variables(environ: Mapping[str, str]) -> str | None:
    """The message naming the unknown ``DDP_SIGTERM_*`` variables, None if there are none."""
    known = {_variable(field.name) for cls in _SETTINGS for field in dataclasses.fields(cls)}
    unknown = sorted(k for k in environ if k.startswith(ENV_PREFIX + "_") and k not in known)
    if not unknown:
        return None
    return f"Unknown environment variable(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"


def _parse(var: str, raw: str, kind: Any) -> Any:
    text = raw.strip()
    if kind in (bool, "bool"):
        if text.lower() in _TRUE | _FALSE:
            return text.lower() in _TRUE
        raise SettingsError(f"{var}={raw!r}: expected one of 1/0, true/false, yes/no, on/off")
    for number, expected in ((int, "a whole number"), (float, "a number")):
        if kind in (number, number.__name__):
            try:
                return number(text)
            except ValueError:
                raise SettingsError(f"{var}={raw!r}: expected {expected}") from None
    return text
