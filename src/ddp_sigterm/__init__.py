"""ddp_sigterm: every DDP rank stops at the same step on SIGTERM, saves one checkpoint, exits 128+signal.

The core (:class:`StopCoordinator`, :class:`Settings`) needs torch only. The Lightning callback,
:class:`UnisonStop`, is imported on first use so that ``import ddp_sigterm`` does not import Lightning.
"""

from __future__ import annotations

from typing import Any

from ddp_sigterm.agreement import AgreementError
from ddp_sigterm.coordinator import StopCoordinator, StopDecision
from ddp_sigterm.settings import Settings, SettingsError

__version__ = "0.1.0"
__all__ = ["AgreementError", "Settings", "SettingsError", "StopCoordinator", "StopDecision", "UnisonStop", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("UnisonStop", "StopError"):
        from lightning_utilities.core.imports import RequirementCache

        lightning = RequirementCache("lightning>=2.5.1")
        if not lightning:
            raise ModuleNotFoundError(f"ddp_sigterm.{name} is the Lightning integration: {lightning.message}")
        from ddp_sigterm import lightning_integration

        return getattr(lightning_integration, name)
    raise AttributeError(f"module 'ddp_sigterm' has no attribute {name!r}")
