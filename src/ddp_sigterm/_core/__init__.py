"""The framework-agnostic core: signals, the agreement, the heartbeat, the deadline, the coordinator, the
checked save, what the package does to the process (``process``) and the log. Torch only: nothing here
imports Lightning."""
