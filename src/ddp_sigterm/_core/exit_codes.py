"""What a process ends with after a stop: every outcome of a stop is retryable (128-255, for Kubeflow and the usual
``podFailurePolicy`` rules); an error of the run keeps Python's 1. Table: docs/reliability.md."""

STOP_FAILED = 200  # every rank stopped at the same step, but saving the stop checkpoint (or requeueing) failed
GAVE_UP = 201  # the stop was abandoned: the deadline passed or a third stop request came


def stopped(signum: int) -> int:
    """An agreed, completed stop: 128 + the signal, as if the signal had ended the process."""
    return 128 + signum
