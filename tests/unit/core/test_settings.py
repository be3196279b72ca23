"""ddp_sigterm/_core/settings.py: the defaults, the environment's precedence over the code, and the messages
of bad values."""

from __future__ import annotations

import math

import pytest

from ddp_sigterm import NoticeSettings, Settings, SettingsError
from ddp_sigterm._core.settings import resolve
from ddp_sigterm._lightning.settings import TrainerSettings


def test_settings_defaults_and_environment_precedence() -> None:
    assert Settings().max_delay == 1.0
    assert Settings().signals == ("SIGTERM",)
    code = Settings.resolve(environ={}, max_delay=0.5)
    assert code.max_delay == 0.5
    env = Settings.resolve(environ={"DDP_SIGTERM_MAX_DELAY": "2.5", "DDP_SIGTERM_SIGNALS": "term, usr2"}, max_delay=0.5)
    assert env.max_delay == 2.5  # the environment overrides the code
    assert env.signals == ("SIGTERM", "SIGUSR2")
    assert Settings.resolve(environ={"DDP_SIGTERM": "0"}).enabled is False
    assert Settings().stop_deadline == 25.0
    assert Settings().destroy_at_exit is True
    assert Settings.resolve(environ={"DDP_SIGTERM_STOP_DEADLINE": "inf"}).stop_deadline == math.inf
    assert Settings().log_level == "INFO"
    assert Settings.resolve(environ={"DDP_SIGTERM_LOG_LEVEL": " warning"}).log_level == "WARNING"
    assert (NoticeSettings().notice, NoticeSettings().notice_url, NoticeSettings().notice_period) == ("off", "", 2.0)
    noticed = resolve(NoticeSettings, environ={"DDP_SIGTERM_NOTICE": "GCE", "DDP_SIGTERM_NOTICE_URL": "http://127.0.0.1:8080",
                                        "DDP_SIGTERM_NOTICE_PERIOD": "0.5"}, notice="aws")
    assert (noticed.notice, noticed.notice_url, noticed.notice_period) == ("gce", "http://127.0.0.1:8080", 0.5)
    trainer = {"DDP_SIGTERM_CHECKPOINT_DIR": "s3://bucket/run", "DDP_SIGTERM_KEEP_CHECKPOINTS": "2",
               "DDP_SIGTERM_RESUME": "yes"}
    stored = resolve(TrainerSettings, environ=trainer, keep_checkpoints=5)
    assert (stored.checkpoint_dir, stored.keep_checkpoints, stored.resume) == ("s3://bucket/run", 2, True)
    default = TrainerSettings()
    assert (default.checkpoint_dir, default.keep_checkpoints, default.resume, default.save_checkpoint) == \
        ("", 0, False, True)
    assert not hasattr(Settings(), "checkpoint_dir")  # the core's settings keep only what the core reads
    assert not hasattr(Settings(), "notice")


def test_the_trainers_variables_are_known_to_the_core() -> None:
    """The Trainer's settings are the integration's, but their variables are no typo to the core's check."""
    Settings.check_environment({"DDP_SIGTERM_RESUME": "1", "DDP_SIGTERM_CHECKPOINT_DIR": "/ckpt",
                                "DDP_SIGTERM_KEEP_CHECKPOINTS": "2", "DDP_SIGTERM_SAVE_CHECKPOINT": "0"})


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"DDP_SIGTERM_MAX_DELAY": "soon"}, "DDP_SIGTERM_MAX_DELAY='soon': expected a number"),
        ({"DDP_SIGTERM_MAX_DELAY": "-1"}, "max_delay must be a positive number"),
        ({"DDP_SIGTERM_SIGNALS": "SIGNOPE"}, "Unknown signal 'SIGNOPE'"),
        ({"DDP_SIGTERM_SIGNALS": "SIGKILL"}, "cannot include SIGKILL"),
        ({"DDP_SIGTERM": "maybe"}, "DDP_SIGTERM='maybe': expected one of"),
        ({"DDP_SIGTERM_STOP_DEADLINE": "0"}, "stop_deadline must be a positive number of seconds or inf"),
        ({"DDP_SIGTERM_STOP_DEADLINE": "nan"}, "stop_deadline must be a positive number of seconds or inf"),
        ({"DDP_SIGTERM_DESTROY_AT_EXIT": "sometimes"}, "DDP_SIGTERM_DESTROY_AT_EXIT='sometimes': expected one of"),
        ({"DDP_SIGTERM_LOG_LEVEL": "LOUD"}, "log_level must be a logging level such as INFO or WARNING, got 'LOUD'"),
        ({"DDP_SIGTERM_NOTICE": "oci"}, "notice must be one of off, auto, aws, gce, azure; got 'oci'"),
        ({"DDP_SIGTERM_NOTICE_URL": "169.254.169.254"}, "notice_url must be an http:// URL, got '169.254.169.254'"),
        ({"DDP_SIGTERM_NOTICE_PERIOD": "0"}, "notice_period must be a positive number of seconds, got 0.0"),
    ],
)
def test_bad_settings_fail_with_a_clear_message(environ: dict[str, str], message: str) -> None:
    component = NoticeSettings if any(name.startswith("DDP_SIGTERM_NOTICE") for name in environ) else Settings
    with pytest.raises(SettingsError) as error:
        resolve(component, environ=environ)
    assert message in str(error.value)


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"DDP_SIGTERM_KEEP_CHECKPOINTS": "two"}, "DDP_SIGTERM_KEEP_CHECKPOINTS='two': expected a whole number"),
        ({"DDP_SIGTERM_KEEP_CHECKPOINTS": "-1"}, "keep_checkpoints must be a whole number, 0 to keep all, got -1"),
        ({"DDP_SIGTERM_RESUME": "later"}, "DDP_SIGTERM_RESUME='later': expected one of"),
        ({"DDP_SIGTERM_SAVE_CHECKPOINT": "2"}, "DDP_SIGTERM_SAVE_CHECKPOINT='2': expected one of"),
    ],
)
def test_bad_trainer_settings_fail_with_the_same_messages(environ: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError) as error:
        resolve(TrainerSettings, environ=environ)
    assert message in str(error.value)


def test_a_misspelt_variable_warns_and_is_an_error_where_the_package_acts() -> None:
    """A typo must not break a process the package never acts on (resolve warns), nor silently leave a
    default in force where it does act (check_environment, at a multi-process start, raises)."""
    typo = {"DDP_SIGTERM_STOP_DEADLIN": "600"}
    with pytest.warns(UserWarning, match=r"Unknown environment variable\(s\) DDP_SIGTERM_STOP_DEADLIN; known: "):
        assert Settings.resolve(environ=typo).stop_deadline == 25.0
    with pytest.raises(SettingsError, match=r"DDP_SIGTERM_STOP_DEADLIN; known: .*DDP_SIGTERM_STOP_DEADLINE"):
        Settings.check_environment(typo)
    Settings.check_environment({"DDP_SIGTERM_STOP_DEADLINE": "600", "OTHER": "1"})  # nothing unknown: no error


def test_keyword_overrides_go_to_the_component_whose_field_they_name(monkeypatch) -> None:
    """``UnisonStop(...)`` and ``FabricStop(...)`` take every component's fields, each to its own settings."""
    from ddp_sigterm.fabric import FabricStop
    from ddp_sigterm.lightning_integration import UnisonStop

    for name in ("DDP_SIGTERM_NOTICE", "DDP_SIGTERM_MAX_DELAY", "DDP_SIGTERM_CHECKPOINT_DIR"):
        monkeypatch.delenv(name, raising=False)
    stop = UnisonStop(max_delay=0.5, notice="AWS", checkpoint_dir="/ckpt")
    assert (stop.settings.max_delay, stop.notice_settings.notice, stop.trainer_settings.checkpoint_dir) == \
        (0.5, "aws", "/ckpt")
    assert FabricStop(notice_period=0.5).notice_settings.notice_period == 0.5
    with pytest.raises(TypeError):
        UnisonStop(notice_every=3)  # a field of no component
