"""The suite's set-up: its support is the package ``ddp_sigterm_tests`` (tests/support, see its __init__), installed
editable by ``make``; a run that would import another checkout's copy, or none, stops here with what to do."""

from __future__ import annotations

from pathlib import Path

import pytest

SUPPORT = Path(__file__).resolve().parent / "support"


def pytest_configure(config: pytest.Config) -> None:
    try:
        import ddp_sigterm_tests
    except ImportError:
        raise pytest.UsageError("the test support package is not installed: `make test` installs it, or "
                                "`pip install -e tests/support` in this environment") from None
    found = Path(ddp_sigterm_tests.__file__).resolve().parent
    if found != SUPPORT:
        raise pytest.UsageError(f"ddp_sigterm_tests comes from {found}, not from this checkout's {SUPPORT}: "
                                "`pip install -e tests/support` here")


def pytest_report_header() -> str:
    return f"test support: {SUPPORT}"
