"""SLURM: requeue the running job, as Lightning's auto-requeue does, once per job.

Called by global rank 0 only, after the agreed stop's checkpoint is saved on every rank.
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


def requeue(environ: Mapping[str, str] | None = None, timeout: float = 60.0) -> str:
    """Run ``scontrol requeue <job id>``; return the job id, or raise :class:`RequeueError`."""
    job = job_id(environ)
    command = ["scontrol", "requeue", job]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise RequeueError(f"ddp_sigterm: {' '.join(command)} could not run: {error}") from error
    if done.returncode != 0:
        raise RequeueError(f"ddp_sigterm: {' '.join(command)} failed with exit code {done.returncode}: "
                           f"{(done.stderr or done.stdout).strip()}")
    return job
