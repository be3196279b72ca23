"""The framework-agnostic core: signals, the agreement, the coordinator, the checked save, the process's
runtime. Torch only: nothing here imports Lightning."""
