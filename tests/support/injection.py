"""The faults a scenario job sends itself: parsed once, here, by the tests and by the job scripts alike.

A job takes them from ``Scenario.inject``: entries ``rank:batch[:phase[:SIGNAL]]`` separated by ``;``
("1:2:forward;0:*:save"), each sent once. ``batch`` counts from 1 within the run, ``*`` is any batch;
the phase defaults to ``forward`` and the signal to SIGTERM. Tests write that text (or :func:`encode`
:class:`Injection` entries) and a Scenario checks it when it is made, so that a typo fails in the test,
not as a job that was never signalled.
"""

from __future__ import annotations

import dataclasses
import signal

# "validation" also means the test and predict batches of trainer.test / trainer.predict; "save" is while a
# checkpoint is being saved (the stop checkpoint, in these scenarios).
PHASES = ("batch_start", "forward", "backward", "optimizer", "validation", "epoch_end", "train_end", "save")


@dataclasses.dataclass(frozen=True)
class Injection:
    rank: int
    batch: int | None  # None: any batch ("*")
    phase: str = "forward"
    signal: str = "SIGTERM"

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"unknown phase {self.phase!r}; known: {', '.join(PHASES)}")
        if self.signal not in signal.Signals.__members__:
            raise ValueError(f"unknown signal {self.signal!r}")

    @property
    def signum(self) -> int:
        return int(signal.Signals[self.signal])

    def matches(self, rank: int, batch: int, phase: str) -> bool:
        return rank == self.rank and phase == self.phase and self.batch in (None, batch)

    def __str__(self) -> str:
        text = f"{self.rank}:{'*' if self.batch is None else self.batch}:{self.phase}"
        return text if self.signal == "SIGTERM" else f"{text}:{self.signal}"


def parse(text: str) -> list[Injection]:
    """``Scenario.inject``'s entries, in order; raises ValueError on a malformed one."""
    found = []
    for entry in filter(None, text.split(";")):
        rank, batch, *rest = entry.split(":")
        if len(rest) > 2:
            raise ValueError(f"{entry!r}: expected rank:batch[:phase[:SIGNAL]]")
        found.append(Injection(int(rank), None if batch == "*" else int(batch), *rest))
    return found


def encode(injections: str | list[Injection]) -> str:
    """The ``Scenario.inject`` text of ``injections`` (text is checked by parsing it)."""
    return ";".join(str(i) for i in (parse(injections) if isinstance(injections, str) else injections))
