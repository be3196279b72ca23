"""SLURM: requeue the running job, as Lightning's auto-requeue does, once per job; and tell a
preemption from the other SIGTERMs.

Called by global rank 0 only, after the agreed stop's checkpoint is saved on every rank.

With a grace time (``GraceTime`` > 0), SLURM requeues a job it preempts (``PreemptMode=REQUEUE``)
only if the job is still running when the grace time ends and SLURM kills it. A job that saves and
exits within the grace time, as a stop should, ends FAILED and is not requeued: the job must requeue
itself. A preemption's SIGTERM looks like any other (``scancel``, the time limit), but ``scontrol show
job`` tells them apart: a job being preempted has a ``PreemptTime`` (at or after its ``StartTime``: the
field stays set after a requeue the job asks for). With ``GraceTime=0`` SLURM requeues the job at the
preemption itself and shows no ``PreemptTime``: the package then saves and does not requeue again
(tested: docs/slurm.md).
"""

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
    """The ``PreemptTime`` of this job if SLURM is preempting it and lets it be requeued (``Requeue=1``:
    ``sbatch --requeue`` or the cluster's ``JobRequeue=1``), else None; raise :class:`RequeueError` if
    ``scontrol`` cannot tell. Whatever the cluster's preemption mode: on a cluster that cancels preempted
    jobs, a job submitted with ``--requeue`` is requeued (submit with ``--no-requeue`` to keep the cancel)."""
    job = job_id(environ)
    fields = dict(item.partition("=")[::2] for item in _scontrol("show", "job", "--oneliner", job,
                                                                   timeout=timeout).split())
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


# scontrol runs inside the job's step, and SLURM signals every process of the step when the job is requeued: the
# requeue's own SIGTERM can reach ``scontrol requeue`` after slurmctld has requeued the job and before scontrol has
# exited (seen in CI: exit code -15, the job requeued). The rank is stopping already; scontrol starts with SIGTERM
# ignored (kept across exec), so that it finishes and reports what slurmctld did. Its timeout still ends it.
_IGNORING_SIGTERM = ("/bin/sh", "-c", 'trap "" TERM; exec scontrol "$@"', "scontrol")


def _scontrol(*args: str, timeout: float) -> str:
    """``scontrol``'s output, or :class:`RequeueError` with the command and its error."""
    command = ["scontrol", *args]
    try:
        # times as YYYY-MM-DDTHH:MM:SS, whatever the user's SLURM_TIME_FORMAT (preempted() compares them as text)
        done = subprocess.run([*_IGNORING_SIGTERM, *args], capture_output=True, text=True, timeout=timeout,
                              check=False, env={**os.environ, "SLURM_TIME_FORMAT": "standard"})
    except (OSError, subprocess.TimeoutExpired) as error:
        raise RequeueError(f"ddp_sigterm: {' '.join(command)} could not run: {error}") from error
    if done.returncode != 0:
        raise RequeueError(f"ddp_sigterm: {' '.join(command)} failed with exit code {done.returncode}: "
                           f"{(done.stderr or done.stdout).strip()}")
    return done.stdout
