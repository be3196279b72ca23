"""The framework-agnostic core: signals, the agreement and its cadence, the heartbeat, the deadline, the
coordinator, the checked save and the log. Torch only: nothing here imports Lightning."""
