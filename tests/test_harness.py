"""The suite's own tools: the fault injections a scenario job sends itself (tests/injection.py)."""

from __future__ import annotations

import pytest
from injection import Injection, encode, parse


def test_fault_injections_are_parsed_once_and_checked() -> None:
    assert parse("1:2:forward;0:*:save:SIGUSR1;1:3") == [
        Injection(1, 2, "forward"), Injection(0, None, "save", "SIGUSR1"), Injection(1, 3, "forward")]
    assert encode("1:2:forward;0:*:save:SIGUSR1") == "1:2:forward;0:*:save:SIGUSR1"
    assert Injection(0, None, "save").matches(0, 7, "save")
    assert not Injection(0, 2, "save").matches(0, 7, "save")
    malformed = {"1:2:fwd": "unknown phase 'fwd'", "1:2:forward:SIGNOPE": "unknown signal 'SIGNOPE'",
                 "one:2": "invalid literal for int", "1:2:forward:SIGTERM:extra": "expected rank:batch"}
    for bad, why in malformed.items():
        with pytest.raises(ValueError, match=why):
            parse(bad)
