"""Settings: validated dataclasses, overridden by ``DDP_SIGTERM_<FIELD>`` environment variables.

Precedence, lowest to highest: field defaults, arguments in code, the environment (docs/configuration.md). Read so
are this :class:`Settings`, ``notices.NoticeSettings`` and ``_lightning.settings.TrainerSettings``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import warnings
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")
ENV_PREFIX = "DDP_SIGTERM"
_BOOLS = {**dict.fromkeys(("1", "true", "yes", "on"), True), **dict.fromkeys(("0", "false", "no", "off"), False)}
_PARSERS: dict[str, tuple[Callable[[str], Any], str]] = {  # a field's type name: its parser, what it expects
    "bool": (lambda text: _BOOLS[text.lower()], "one of 1/0, true/false, yes/no, on/off"),
    "int": (int, "a whole number"),
    "float": (float, "a number"),
}
_SETTINGS: list[type[Any]] = []  # every settings dataclass read from DDP_SIGTERM_<FIELD>


class SettingsError(ValueError):
    """A setting or its environment variable has a value that cannot work."""


def signal_number(name: str | int | signal.Signals) -> int:
    """The number of a signal given as ``"SIGTERM"``, ``"TERM"``, ``15`` or ``signal.SIGTERM``."""
    if isinstance(name, str) and not name.strip().isdigit():
        text = name.strip().upper()
        try:
            return int(signal.Signals[text if text.startswith("SIG") else "SIG" + text])
        except KeyError:
            raise SettingsError(f"Unknown signal {name!r}; use a name such as SIGTERM or SIGUSR2"
                                f" (check {ENV_PREFIX}_SIGNALS if you set it)") from None
    try:
        return int(signal.Signals(int(name)))
    except ValueError:
        raise SettingsError(f"{int(name)} is not a signal number on this platform") from None


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
            kind = field.type if isinstance(field.type, str) else field.type.__name__  # "bool", also unpostponed
            parse, expected = _PARSERS.get(kind, (str, ""))
            try:
                values[field.name] = parse(environ[var].strip())
            except (KeyError, ValueError):
                raise SettingsError(f"{var}={environ[var]!r}: expected {expected}") from None
    return cls(**values)


def check_bools(settings: object, *names: str) -> None:
    for name in names:
        if not isinstance(getattr(settings, name), bool):
            raise SettingsError(f"{name} must be a bool, got {getattr(settings, name)!r}")


def check_seconds(settings: object, *names: str, or_inf: bool = False) -> None:
    """Each of ``names`` is a positive number of seconds (``or_inf``: or infinite)."""
    for name in names:
        value = getattr(settings, name)
        if not isinstance(value, (int, float)) or not value > 0 or (math.isinf(value) and not or_inf):
            also = " or inf" if or_inf else ""
            raise SettingsError(f"{name} must be a positive number of seconds{also}, got {value!r}")


@read_from_environment
@dataclasses.dataclass(frozen=True)
class Settings:
    """How the stop is detected and agreed; every field can be overridden by ``DDP_SIGTERM_<FIELD>``."""

    enabled: bool = True
    """Master switch. ``DDP_SIGTERM=0`` (no suffix) turns the package off: stock behaviour."""

    signals: tuple[str, ...] = ("SIGTERM",)
    """Signals that request a stop; environment: comma-separated, e.g. ``SIGTERM,SIGUSR2``. Not SIGKILL/SIGSTOP."""

    max_delay: float = 1.0
    """Seconds: a stop is agreed within ``max(max_delay, 2 steps)`` of the first signal; the heartbeat's period is
    ``max_delay / 2``."""

    agreement_timeout: float = 600.0
    """Seconds one agreement may wait for the slowest rank (skew, not step time) before it fails, naming both."""

    connect_timeout: float = 30.0
    """Seconds Gloo may wait for each connection of the package's own groups at start-up (else it steps aside)."""

    stop_deadline: float = 25.0
    """Seconds from the first stop signal (or the agreed stop) within which a multi-process run's process must
    have exited; past it, it says what it waited for and exits 201. ``inf`` turns it off."""

    destroy_at_exit: bool = True
    """After an agreed stop of a multi-process run, destroy the default gloo group at exit (else it may abort)."""

    log_level: str = "INFO"
    """Level of the ``ddp_sigterm`` logger. At INFO every rank logs a stop, and a run without one nothing."""

    def __post_init__(self) -> None:
        check_bools(self, "enabled", "destroy_at_exit")
        given: object = self.signals  # the environment gives "SIGTERM,SIGUSR2"; so may code
        names = [s for s in given.split(",") if s.strip()] if isinstance(given, str) else self.signals
        if not names:
            raise SettingsError("signals must name at least one signal, e.g. SIGTERM")
        numbers = dict.fromkeys(signal_number(s) for s in names)
        if uncatchable := sorted({signal.SIGKILL, signal.SIGSTOP} & numbers.keys()):
            named = ", ".join(signal.Signals(n).name for n in uncatchable)
            raise SettingsError(f"signals cannot include {named}: they cannot be caught")
        object.__setattr__(self, "signals", tuple(signal.Signals(n).name for n in numbers))
        check_seconds(self, "max_delay", "agreement_timeout", "connect_timeout")
        check_seconds(self, "stop_deadline", or_inf=True)
        level = self.log_level.strip().upper() if isinstance(self.log_level, str) else self.log_level
        if not isinstance(logging.getLevelName(level), int):
            raise SettingsError(f"log_level must be a logging level such as INFO or WARNING, got {self.log_level!r}")
        object.__setattr__(self, "log_level", level)

    @property
    def signal_numbers(self) -> tuple[int, ...]:
        return tuple(signal_number(s) for s in self.signals)

    @classmethod
    def resolve(cls, environ: Mapping[str, str] | None = None, **given: Any) -> Settings:
        """:func:`resolve`; an unknown ``DDP_SIGTERM_*`` variable only warns here: a process the package never
        acts on must not fail for it (:meth:`check_environment` makes it an error)."""
        environ = os.environ if environ is None else environ
        try:
            cls.check_environment(environ)
        except SettingsError as unknown:
            warnings.warn(str(unknown), stacklevel=2)
        return resolve(cls, environ, **given)

    @staticmethod
    def check_environment(environ: Mapping[str, str] | None = None) -> None:
        """Raise :class:`SettingsError` for a ``DDP_SIGTERM_*`` variable no setting has (a typo would silently
        leave a default in force): called where the package is about to act on a multi-process run."""
        known = {_variable(field.name) for cls in _SETTINGS for field in dataclasses.fields(cls)}
        unknown = sorted(k for k in (os.environ if environ is None else environ)
                         if k.startswith(ENV_PREFIX + "_") and k not in known)
        if unknown:
            raise SettingsError(f"Unknown environment variable(s) {', '.join(unknown)}; "
                                f"known: {', '.join(sorted(known))}")


def _variable(field: str) -> str:
    return ENV_PREFIX if field == "enabled" else f"{ENV_PREFIX}_{field.upper()}"
