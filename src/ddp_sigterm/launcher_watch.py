"""Lightning's own launcher (``Trainer(devices=N)`` or ``fabric.launch()`` without torchrun or srun).

Rank 0 starts the other ranks and runs a thread (``_ChildProcessObserver``) that wakes every 5 s and,
once a child has exited non-zero, SIGKILLs every rank, rank 0 included, "to avoid zombies". After an
agreed stop every rank exits on its own with 128 + signal: a child that is a moment faster than rank 0
would have rank 0 SIGKILLed (exit -9 instead of 143), cutting short whatever rank 0 still does. So at
the agreed stop that thread is retired; a rank that then fails to exit is the stop deadline's to end.
"""

from __future__ import annotations

import threading


def retire_child_watch() -> None:
    """Make Lightning's child-process watch, if this process runs one, end at its next wake without
    acting. Called at the agreed stop, while every rank is still alive, so the watch has nothing to
    act on at that moment. (Where nothing follows the agreement — a stop in validate/test/predict,
    no checkpoint — another rank could in principle exit before rank 0 returns from it and retires
    the watch; the watch wakes every 5 s, the gap is milliseconds.)"""
    for thread in threading.enumerate():
        if type(thread).__name__ == "_ChildProcessObserver" and hasattr(thread, "_run"):
            thread._run = _stop_watching  # type: ignore[attr-defined]


def _stop_watching() -> bool:
    return True  # the watch's loop takes True as "finished"
