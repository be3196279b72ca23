"""SLURM: requeue the running job once per job, as Lightning's auto-requeue does (SLURM requeues a preempted job
only if it outlives its grace time, which a stop should not), and tell a preemption from the other SIGTERMs
(``PreemptTime``). Called by global rank 0 only, after the stop checkpoint is saved (docs/slurm.md)."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Mapping

_JOB_ID = re.compile(r"[0-9]+(_[0-9]+)?")


class RequeueError(RuntimeError):
    """``scontrol requeue`` could not be run or failed; the message has its output."""


def job_id(environ: Mapping[str, str] | None = None) -> str:
    """The id ``scontrol requeue`` needs: ``<array job>_<task>`` in an array job, else the job id."""
    environ = os.environ if environ is None else environ
    if "SLURM_ARRAY_JOB_ID" in environ:
        found = f"{environ['SLURM_ARRAY_JOB_ID']}_{environ.get('SLURM_ARRAY_TASK_ID', '')}"
    elif "SLURM_JOB_ID" in environ:
        found = environ["SLURM_JOB_ID"]
    else:
        raise RequeueError("ddp_sigterm: cannot requeue: SLURM_JOB_ID is not set (not running under SLURM?)")
    if not _JOB_ID.fullmatch(found):
        raise RequeueError(f"ddp_sigterm: cannot requeue: {found!r} is not a SLURM job id")
    return found


def preempted(environ: Mapping[str, str] | None = None, timeout: float = 10.0) -> str | None:
    """The ``PreemptTime`` of this job if SLURM is preempting it and lets it be requeued (``Requeue=1``), else None;
    raises :class:`RequeueError` if ``scontrol`` cannot tell."""
    shown = _scontrol("show", "job", "--oneliner", job_id(environ), timeout=timeout)
    fields = dict(item.partition("=")[::2] for item in shown.split())
    preempt_time, start_time = fields.get("PreemptTime", "None"), fields.get("StartTime", "")
    # both are ISO 8601 local times (YYYY-MM-DDTHH:MM:SS): their text sorts as the times do
    if fields.get("Requeue") == "1" and preempt_time not in ("None", "Unknown") and preempt_time >= start_time:
        return preempt_time
    return None


def requeue(environ: Mapping[str, str] | None = None, timeout: float = 60.0) -> str:
    """Run ``scontrol requeue <job id>``; return the job id, or raise :class:`RequeueError`."""
    job = job_id(environ)
    _scontrol("requeue", job, timeout=timeout)
    return job


# The requeue's own SIGTERM reaches every process of the job's step, ``scontrol requeue`` included, possibly before
# it has reported what slurmctld did: it starts with SIGTERM ignored (kept across exec); its timeout still ends it.
_IGNORING_SIGTERM = ("/bin/sh", "-c", 'trap "" TERM; exec scontrol "$@"', "scontrol")


def _scontrol(*args: str, timeout: float) -> str:
    """``scontrol``'s output, or :class:`RequeueError` with the command and its error."""
    command = " ".join(("scontrol", *args))
    try:
        # times as YYYY-MM-DDTHH:MM:SS, whatever the user's SLURM_TIME_FORMAT (preempted() compares them as text)
        done = subprocess.run([*_IGNORING_SIGTERM, *args], capture_output=True, text=True, timeout=timeout,
                              check=False, env={**os.environ, "SLURM_TIME_FORMAT": "standard"})
    except (OSError, subprocess.TimeoutExpired) as error:
        raise RequeueError(f"ddp_sigterm: {command} could not run: {error}") from error
    if done.returncode != 0:
        raise RequeueError(f"ddp_sigterm: {command} failed with exit code {done.returncode}: "
                           f"{(done.stderr or done.stdout).strip()}")
    return done.stdout
