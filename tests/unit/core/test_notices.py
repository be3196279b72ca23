"""_core/clouds.py and notices.py: each cloud's notice read as its documentation specifies, against a metadata
service on 127.0.0.1 (tests/support/metadata_server.py); a service that hangs, refuses, redirects or answers
garbage raises MetadataError within the timeout; the cloud is found from DMI files alone.

No test here may reach a real metadata address: every socket this module's tests open is checked."""

from __future__ import annotations

import datetime
import ipaddress
import json
import logging
import re
import socket
import threading
import time
from pathlib import Path

import pytest
from ddp_sigterm_tests.metadata_server import AWS_TOKEN_HEADER, AWS_TOKEN_TTL_HEADER, MetadataServer, azure_event

from ddp_sigterm._core import clouds, notices
from ddp_sigterm._core.clouds import MetadataError, Notice

UTC = datetime.timezone.utc
AWS_NOTICE = {"action": "terminate", "time": "2026-12-06T12:02:00Z"}


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any connection to an address outside 127.0.0.0/8 fails the test before it is made."""
    connect = socket.socket.connect

    def checked(self: socket.socket, address: object) -> None:
        if isinstance(address, tuple) and not ipaddress.ip_address(socket.gethostbyname(address[0])).is_loopback:
            pytest.fail(f"a test connected to {address}: only 127.0.0.0/8 is allowed")
        return connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", checked)


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- the answers ---------------------------------------------------------------------------------
def test_aws_answers() -> None:
    assert clouds.aws_notice(404, b"Not Found") is None
    notice = clouds.aws_notice(200, json.dumps(AWS_NOTICE).encode())
    assert notice == Notice("aws", "terminate", datetime.datetime(2026, 12, 6, 12, 2, tzinfo=UTC))
    for action in ("stop", "hibernate"):
        assert clouds.aws_notice(200, json.dumps({**AWS_NOTICE, "action": action}).encode()).action == action
    for status, body, reason in [(200, b"<html>", "not an interruption"), (200, b'{"action": "terminate"}', "time"),
                                 (200, b'{"action": "reboot", "time": "2026-12-06T12:02:00Z"}', "unknown action"),
                                 (500, b"", "HTTP 500")]:
        with pytest.raises(MetadataError, match=reason):
            clouds.aws_notice(status, body)


def test_gce_answers() -> None:
    seen = datetime.datetime(2026, 12, 6, 12, 0, tzinfo=UTC)
    assert clouds.gce_notice(b"FALSE", seen) is None
    notice = clouds.gce_notice(b"TRUE", seen)
    assert (notice.cloud, notice.action, notice.at) == ("gce", "preempted", seen + datetime.timedelta(seconds=30))
    with pytest.raises(MetadataError, match="not TRUE or FALSE"):
        clouds.gce_notice(b"true-ish", seen)


def test_azure_answers() -> None:
    def read(events: list[dict]) -> Notice | None:
        return clouds.azure_notice(json.dumps({"DocumentIncarnation": 1, "Events": events}).encode(), "vm-1")

    assert read([]) is None
    assert read([azure_event("vm-2")]) is None  # another VM of the scale set
    assert read([azure_event("vm-1", event_type="Freeze")]) is None
    notice = read([azure_event("vm-2"), azure_event("vm-3", "vm-1")])
    assert notice == Notice("azure", "Preempt", datetime.datetime(2026, 12, 6, 12, 0, 30, tzinfo=UTC),
                            "EventId Preempt-vm-3-vm-1")
    assert read([azure_event("vm-1", not_before="")]).at is None  # started already
    for body, reason in [(b"[]", "not a list of events"), (b'{"Events": [{"EventType": "Preempt"}]}', "Resources"),
                         (json.dumps({"Events": [azure_event("vm-1", not_before="soon")]}).encode(), "RFC 1123")]:
        with pytest.raises(MetadataError, match=reason):
            clouds.azure_notice(body, "vm-1")


def test_the_cloud_is_found_from_files_alone(tmp_path: Path) -> None:
    dmi = "class/dmi/id/"
    machines = {
        "aws": {dmi + "sys_vendor": "Amazon EC2", dmi + "product_name": "m7i.large"},
        "aws-xen": {"hypervisor/uuid": "ec2e1916-9099-7caf-fd21-012345abcdef", dmi + "sys_vendor": "Xen"},
        "aws-uuid": {dmi + "product_uuid": "EC2E1916-9099-7CAF-FD21-012345ABCDEF"},
        "aws-little-endian": {dmi + "product_uuid": "45E12AEC-DCD1-B213-94ED-012345ABCDEF"},
        "gce": {dmi + "sys_vendor": "Google", dmi + "product_name": "Google Compute Engine"},
        "gce-serial": {dmi + "product_serial": "GoogleCloud-0123456789ABCDEF"},
        "azure": {dmi + "sys_vendor": "Microsoft Corporation", dmi + "product_name": "Virtual Machine",
                  dmi + "chassis_asset_tag": "7783-7084-3265-9085-8269-3286-77"},
        "hyper-v": {dmi + "sys_vendor": "Microsoft Corporation", dmi + "product_name": "Virtual Machine",
                    dmi + "chassis_asset_tag": "0000-0000-0000-0000"},
        "qemu": {dmi + "sys_vendor": "QEMU", dmi + "product_name": "Standard PC (Q35 + ICH9, 2009)",
                 dmi + "product_uuid": "6c4bf0e2-1f3a-4d5e-9a0b-0123456789ab"},
        "none": {},
    }
    found = {}
    for machine, files in machines.items():
        for name, text in files.items():
            (tmp_path / machine / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / machine / name).write_text(text + "\n")
        found[machine] = clouds.detect_cloud(tmp_path / machine)
    assert found == {"aws": "aws", "aws-xen": "aws", "aws-uuid": "aws", "aws-little-endian": "aws", "gce": "gce",
                     "gce-serial": "gce", "azure": "azure", "hyper-v": None, "qemu": None, "none": None}


def test_this_machine_is_no_cloud_vm() -> None:
    """``auto`` must contact nothing here or in CI: by its DMI data, this machine is in no cloud."""
    assert clouds.detect_cloud() is None


# -- the sources, against a service on 127.0.0.1 -------------------------------------------------------
def test_aws_imdsv2_asks_a_token_once_and_sends_it() -> None:
    with MetadataServer("aws") as server:
        source = clouds.source("aws", server.url)
        assert source.poll(timeout=2) is None
        assert source.poll(timeout=2) is None
        server.notice = AWS_NOTICE
        assert source.poll(timeout=2) == Notice("aws", "terminate", datetime.datetime(2026, 12, 6, 12, 2, tzinfo=UTC))
    puts = [r for r in server.requests if r.method == "PUT"]
    gets = [r for r in server.requests if r.method == "GET"]
    assert [r.path for r in puts] == ["/latest/api/token"]
    assert puts[0].headers[AWS_TOKEN_TTL_HEADER.lower()] == "21600"
    assert [r.path for r in gets] == ["/latest/meta-data/spot/instance-action"] * 3
    assert all(r.headers[AWS_TOKEN_HEADER.lower()].startswith("token-0-") for r in gets)


def test_aws_asks_a_new_token_when_its_token_lapses() -> None:
    with MetadataServer("aws") as server:
        source = clouds.source("aws", server.url)
        assert source.poll(timeout=2) is None
        server.revoke_tokens()
        server.notice = AWS_NOTICE
        assert source.poll(timeout=2).action == "terminate"
    assert [r.method for r in server.requests] == ["PUT", "GET", "GET", "PUT", "GET"]  # the 401, then a new token


def test_aws_imdsv1_only_instance_is_asked_without_a_token() -> None:
    with MetadataServer("aws", imdsv2="absent") as server:
        source = clouds.source("aws", server.url)
        assert source.poll(timeout=2) is None
        server.notice = AWS_NOTICE
        assert source.poll(timeout=2).action == "terminate"
    assert all(AWS_TOKEN_HEADER.lower() not in r.headers for r in server.requests if r.method == "GET")


def test_aws_without_a_token_where_imdsv2_is_required_says_what_to_change() -> None:
    """The token's PUT times out (in a container, its answer cannot take a second hop) and the instance
    refuses IMDSv1."""
    with MetadataServer("aws") as server:
        server.token_delay = 1.0
        source = clouds.source("aws", server.url)
        with pytest.raises(MetadataError, match=r"401.*api/token failed: timed out\).*hop limit must be 2"):
            source.poll(timeout=0.5)


def test_gce_sends_and_wants_metadata_flavor_google() -> None:
    with MetadataServer("gce") as server:
        source = clouds.source("gce", server.url)
        assert source.poll(timeout=2) is None
        server.notice = True
        before = datetime.datetime.now(UTC)
        notice = source.poll(timeout=2)
        assert notice is not None
        assert notice.action == "preempted"
        assert before + datetime.timedelta(seconds=29) < notice.at < before + datetime.timedelta(seconds=32)
    assert {r.headers["metadata-flavor"] for r in server.requests} == {"Google"}
    assert {r.path for r in server.requests} == {"/computeMetadata/v1/instance/preempted"}


def test_azure_asks_its_name_once_and_reads_only_its_own_azure_event() -> None:
    with MetadataServer("azure", vm_name="vm-1") as server:
        source = clouds.source("azure", server.url)
        assert source.poll(timeout=2) is None
        server.notice = [azure_event("vm-2"), azure_event("vm-1", event_type="Reboot")]
        assert source.poll(timeout=2) is None
        server.notice = [azure_event("vm-2"), azure_event("vm-1")]
        notice = source.poll(timeout=2)
        assert notice is not None
        assert notice.detail == "EventId Preempt-vm-1"
    paths = [r.path.split("?")[0] for r in server.requests]
    assert paths == ["/metadata/instance/compute/name"] + ["/metadata/scheduledevents"] * 3
    assert {r.headers["metadata"] for r in server.requests} == {"true"}
    assert all("api-version=" in r.path for r in server.requests)


@pytest.mark.parametrize("cloud", clouds.CLOUDS)
def test_a_slow_service_fails_within_the_timeout(cloud: str) -> None:
    with MetadataServer(cloud, imdsv2="optional") as server:
        server.delay = 5.0
        source = clouds.source(cloud, server.url)
        began = time.monotonic()
        with pytest.raises(MetadataError, match="timed out"):
            source.poll(timeout=0.3)
        took = time.monotonic() - began
    assert took < 2.0, f"{cloud}: a poll with a 0.3 s timeout took {took:.1f} s"  # AWS: token PUT + GET


@pytest.mark.parametrize("cloud", clouds.CLOUDS)
def test_a_refused_connection_or_garbage_raises(cloud: str) -> None:
    with pytest.raises(MetadataError, match="refused"):
        clouds.source(cloud, f"http://127.0.0.1:{closed_port()}").poll(timeout=2)
    with MetadataServer(cloud, imdsv2="optional") as server:
        server.garbage = True
        with pytest.raises(MetadataError):
            clouds.source(cloud, server.url).poll(timeout=2)


@pytest.mark.parametrize("cloud", clouds.CLOUDS)
def test_no_proxy_and_no_redirect_take_a_request_elsewhere(cloud: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{closed_port()}")
    with MetadataServer(cloud, imdsv2="optional") as server, MetadataServer(cloud, imdsv2="optional") as elsewhere:
        assert clouds.source(cloud, server.url).poll(timeout=2) is None  # the proxy's port is closed
        server.redirect_to = f"{elsewhere.url}/"
        with pytest.raises(MetadataError):
            clouds.source(cloud, server.url).poll(timeout=2)
    assert elsewhere.requests == []


def test_sources_take_only_http_urls_and_contact_nothing_when_made() -> None:
    for cloud in clouds.CLOUDS:
        assert clouds.source(cloud).base_url == clouds.DEFAULT_URLS[cloud]  # made, never polled here
        with pytest.raises(ValueError, match="must start with http://"):
            clouds.source(cloud, "file:///etc/passwd")
    with pytest.raises(ValueError, match="no notice source for 'oci'"):
        clouds.source("oci")


# -- the watch -----------------------------------------------------------------------------------------
def test_the_watch_hands_on_one_notice_and_ends() -> None:
    with MetadataServer("gce") as server:
        noticed: list[Notice] = []
        watch = notices.NoticeWatch(clouds.source("gce", server.url), 0.05, noticed.append)
        thread = threading.Thread(target=watch.watch)
        thread.start()
        time.sleep(0.3)
        assert noticed == []
        server.notice = True
        thread.join(timeout=5)
        assert not thread.is_alive()
        assert [n.cloud for n in noticed] == ["gce"]
        polls = len(server.requests)
        time.sleep(0.2)
        assert len(server.requests) == polls  # nothing asked after the notice


def test_a_failing_service_is_logged_once_and_the_watch_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    with MetadataServer("azure") as server, caplog.at_level(logging.WARNING, logger="ddp_sigterm"):
        server.garbage = True
        watch = notices.NoticeWatch(clouds.source("azure", server.url), 0.02, lambda notice: None)
        thread = threading.Thread(target=watch.watch)
        thread.start()
        while watch.polls < 5 and thread.is_alive():
            time.sleep(0.02)
        server.delay = 10.0  # end() while a request hangs: the thread leaves within the request's timeout
        time.sleep(0.2)
        ended = time.monotonic()
        watch.end()
        thread.join(timeout=10)
        took = time.monotonic() - ended
    assert not thread.is_alive()
    assert took < notices.POLL_TIMEOUT + 1, took
    warnings = [r.getMessage() for r in caplog.records if r.name == "ddp_sigterm"]
    assert len(warnings) == 1, warnings
    assert re.match(r"the azure preemption notice cannot be read \(azure: GET http://127\.0\.0\.1:\d+/metadata/instance/"
                    r"compute/name\?api-version=2020-07-01&format=text answered '<html>.*', not a VM's name\); the run "
                    r"goes on", warnings[0]), warnings[0]
