"""What a process ends with after a stop, so that an orchestrator can tell "retry me" from a bug.

Kubeflow's ``ExitCode`` restart policy and the usual Kubernetes ``podFailurePolicy`` rules treat 1-127
as permanent failures and 128-255 as retryable. Every outcome of a stop request is retryable: the job
was told to stop, and the newest complete stop checkpoint (or the start) is there to resume from. An
error of the run itself (a bug, bad settings, a peer that crashed) keeps Python's 1. The table, with
what to do for each code, is in docs/reliability.md.
"""

from __future__ import annotations

STOP_FAILED = 200
"""Every rank stopped at the same step, but saving the stop checkpoint (or requeueing the SLURM job)
failed on some rank: :class:`ddp_sigterm.StopError`. The previous stop checkpoint, if any, is intact."""

GAVE_UP = 201
"""The stop was abandoned: the deadline passed or a third stop request came (a peer frozen or gone, a
save that took too long). Nothing of this stop was named a checkpoint."""


def stopped(signum: int) -> int:
    """The code of an agreed, completed stop: 128 + the signal, as if the signal had ended the process."""
    return 128 + signum
