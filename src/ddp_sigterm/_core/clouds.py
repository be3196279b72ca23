"""Each cloud's preemption notice: pure readers of its metadata service's answers, and a source that asks it
(``base_url`` only: no proxy, no redirect, a timeout, a bounded answer; a failure is a :class:`MetadataError`
naming the cloud and the request). :func:`detect_cloud` reads files, never the network. docs/cloud-notices.md.
"""

from __future__ import annotations

import dataclasses
import datetime
import email.utils
import http.client
import json
import re
import time
import urllib.parse
from collections.abc import Mapping
from pathlib import Path

CLOUDS = ("aws", "gce", "azure")
# Used only when ``notice`` names a cloud, or ``auto`` found one in the DMI data; every test gives a 127.0.0.1 URL.
DEFAULT_URLS = {"aws": "http://169.254.169.254", "gce": "http://metadata.google.internal",
                "azure": "http://169.254.169.254"}
GCE_NOTICE_SECONDS = 30.0  # ``preempted`` carries no time: a Spot VM has 30 s from when it turns TRUE to the hard off
# Every (cloud, action) a notice can be: the stop agreement carries a notice as its index here, plus one.
KINDS = (("aws", "terminate"), ("aws", "stop"), ("aws", "hibernate"), ("gce", "preempted"), ("azure", "Preempt"))

_AZURE_NAME = re.compile(r"[\w.-]{1,80}")  # letters, digits, _ . - (a scale set's instance: <set>_<id>)
_MAX_ANSWER = 65536  # bytes read of one answer: a notice is a few hundred
_AWS_TOKEN_SECONDS = 21600  # the longest IMDSv2 token; asked for again a minute before it lapses


class MetadataError(RuntimeError):
    """The metadata service could not be asked, or answered what its documentation does not allow."""


@dataclasses.dataclass(frozen=True)
class Notice:
    """A cloud's word that this machine is about to go: ``action`` in the cloud's terms (:data:`KINDS`), ``at``
    the time it gives (UTC; GCE: 30 s after the notice was seen), ``detail`` what else it said."""

    cloud: str
    action: str
    at: datetime.datetime | None
    detail: str = ""

    @property
    def code(self) -> int:
        return KINDS.index((self.cloud, self.action)) + 1

    @property
    def epoch_seconds(self) -> int:
        """``at`` in whole seconds since the epoch (rounded down), 0 if none."""
        return int(self.at.timestamp()) if self.at is not None else 0

    def describe(self) -> str:
        """As the logs name it, with the detail: ``"the azure preemption notice (Preempt at ...; EventId A1)"``."""
        text = named(self.code, self.epoch_seconds)
        return f"{text[:-1]}; {self.detail})" if self.detail else text


def named(code: int, epoch_seconds: int) -> str:
    """As the logs name a notice the agreement carries: ``"the aws preemption notice (terminate at ...)"``."""
    cloud, action = KINDS[code - 1]
    at = datetime.datetime.fromtimestamp(epoch_seconds, datetime.timezone.utc) if epoch_seconds else None
    return f"the {cloud} preemption notice ({action}{f' at {at.isoformat()}' if at else ''})"


def aws_notice(status: int, body: bytes) -> Notice | None:
    """``spot/instance-action``: 404 until an interruption is scheduled, then ``{"action": ..., "time": ...}``."""
    if status == 404:
        return None
    if status != 200:
        raise MetadataError(f"answered HTTP {status}")
    try:
        answer = json.loads(body)
        action, at = answer["action"], datetime.datetime.strptime(answer["time"], "%Y-%m-%dT%H:%M:%S%z")
    except (ValueError, KeyError, TypeError) as error:
        raise MetadataError(f"answered {_shown(body)}, not an interruption: {error!r}") from None
    if ("aws", action) not in KINDS:
        raise MetadataError(f"answered the unknown action {action!r}")
    return Notice("aws", action, at)


def gce_notice(body: bytes, seen: datetime.datetime) -> Notice | None:
    """``instance/preempted``: ``FALSE``, or ``TRUE`` once the VM is being preempted (seen at ``seen``)."""
    text = body.decode("ascii", "replace").strip()
    if text == "FALSE":
        return None
    if text == "TRUE":
        return Notice("gce", "preempted", seen + datetime.timedelta(seconds=GCE_NOTICE_SECONDS),
                      f"{GCE_NOTICE_SECONDS:g} s after it was seen")
    raise MetadataError(f"answered {_shown(body)}, not TRUE or FALSE")


def azure_notice(body: bytes, vm_name: str) -> Notice | None:
    """Scheduled Events: the first ``Preempt`` event whose ``Resources`` name this VM (others are not notices)."""
    try:
        events = json.loads(body)["Events"]
        preempts = [event for event in events if event["EventType"] == "Preempt" and vm_name in event["Resources"]]
    except (ValueError, KeyError, TypeError) as error:
        raise MetadataError(f"answered {_shown(body)}, not a list of events: {error!r}") from None
    if not preempts:
        return None
    not_before = preempts[0].get("NotBefore") or ""  # empty once the event has started
    try:
        at = email.utils.parsedate_to_datetime(not_before) if not_before else None
    except (ValueError, TypeError):
        raise MetadataError(f"answered the NotBefore {not_before!r}, not an RFC 1123 time") from None
    if at is not None and at.tzinfo is None:  # "-0000": UTC, though RFC 2822 calls it no zone
        at = at.replace(tzinfo=datetime.timezone.utc)
    return Notice("azure", "Preempt", at, f"EventId {preempts[0].get('EventId', '?')}")


def detect_cloud(sysfs: Path = Path("/sys")) -> str | None:
    """The cloud this machine runs in, from files under ``sysfs`` alone (no network), or None (no cloud, or no
    DMI data). The marks are cloud-init's (docs/cloud-notices.md)."""

    def read(name: str) -> str:
        try:
            return (sysfs / name).read_text().strip()
        except OSError:  # absent, or root's only (product_uuid)
            return ""

    dmi = "class/dmi/id/"
    uuids = (read("hypervisor/uuid").lower(), read(dmi + "product_uuid").lower())
    if any(uuid.startswith(("ec2", "45e12aec")) for uuid in uuids) or read(dmi + "sys_vendor") == "Amazon EC2":
        return "aws"
    if read(dmi + "product_name") in ("Google", "Google Compute Engine") or \
            read(dmi + "product_serial").startswith("GoogleCloud-"):
        return "gce"
    if read(dmi + "chassis_asset_tag") == "7783-7084-3265-9085-8269-3286-77":
        return "azure"
    return None


class NoticeSource:
    """Asks one cloud's metadata service at ``base_url`` (or the cloud's own; ``http://`` only)."""

    cloud = ""

    def __init__(self, base_url: str | None = None) -> None:
        url = (base_url or DEFAULT_URLS[self.cloud]).rstrip("/")
        if not url.startswith("http://"):
            raise ValueError(f"the {self.cloud} metadata service's URL must start with http://, got {url!r}")
        self.base_url = url
        self._asked = ""  # the last request: what a MetadataError of this poll is about

    def poll(self, timeout: float) -> Notice | None:
        """Ask once, each request within ``timeout`` s: the notice, None if none yet, or :class:`MetadataError`."""
        try:
            return self._poll(timeout)
        except MetadataError as error:
            raise MetadataError(f"{self.cloud}: {self._asked} {error}") from error

    def _poll(self, timeout: float) -> Notice | None:
        raise NotImplementedError

    def _ask(self, path: str, headers: Mapping[str, str], timeout: float, method: str = "GET",
             expected: tuple[int, ...] = (200,)) -> tuple[int, http.client.HTTPMessage, bytes]:
        """``(status, headers, body)`` of one request; a MetadataError if it fails or its status is not ``expected``.
        http.client follows no redirect and reads no proxy setting: nothing goes past ``base_url``."""
        self._asked = f"{method} {self.base_url}{path}"
        where = urllib.parse.urlsplit(self.base_url)
        connection = http.client.HTTPConnection(where.netloc, timeout=timeout)
        try:
            connection.request(method, where.path + path, headers=dict(headers))
            response = connection.getresponse()
            status, body = response.status, response.read(_MAX_ANSWER)
        except (OSError, http.client.HTTPException) as error:  # timeouts, a connection refused or reset, garbage
            raise MetadataError(f"failed: {error}") from error
        finally:
            connection.close()
        if status not in expected:
            raise MetadataError(f"answered HTTP {status}: {_shown(body)}")
        return status, response.headers, body


class AwsSpot(NoticeSource):
    """EC2's spot interruption notice through IMDSv2 (a session token, renewed before it lapses or after a 401),
    or IMDSv1 where no token can be had."""

    cloud = "aws"
    _token = ""  # "" while none could be had: then each poll asks for one again
    _renew_at = 0.0  # time.monotonic() at which to ask for a new token
    _no_token = ""  # why the last token request failed

    def _poll(self, timeout: float) -> Notice | None:
        path, expected = "/latest/meta-data/spot/instance-action", (200, 401, 404)
        status, _, body = self._ask(path, self._headers(timeout), timeout, expected=expected)
        if status == 401 and self._token:  # the token lapsed or was revoked: once more with a new one
            self._renew_at = 0.0
            status, _, body = self._ask(path, self._headers(timeout), timeout, expected=expected)
        if status == 401:
            raise MetadataError(f"answered 401 (the instance requires IMDSv2) and the session token could not be "
                                f"had ({self._no_token}): in a container, the instance's metadata hop limit must be 2 "
                                "or more")
        return aws_notice(status, body)

    def _headers(self, timeout: float) -> dict[str, str]:
        """The token's header, asking for a token if none is fresh; no header (IMDSv1) if none can be had."""
        if time.monotonic() >= self._renew_at:
            ttl = {"X-aws-ec2-metadata-token-ttl-seconds": str(_AWS_TOKEN_SECONDS)}
            try:
                self._token = self._ask("/latest/api/token", ttl, timeout, "PUT")[2].decode("ascii", "replace").strip()
            except MetadataError as error:
                self._token, self._no_token = "", f"{self._asked} {error}"
            self._renew_at = time.monotonic() + _AWS_TOKEN_SECONDS - 60 if self._token else 0.0
        return {"X-aws-ec2-metadata-token": self._token} if self._token else {}


class GcePreempted(NoticeSource):
    """GCE's ``instance/preempted``, with ``Metadata-Flavor: Google`` asked and required in the answer."""

    cloud = "gce"

    def _poll(self, timeout: float) -> Notice | None:
        _, headers, body = self._ask("/computeMetadata/v1/instance/preempted", {"Metadata-Flavor": "Google"}, timeout)
        if headers.get("Metadata-Flavor") != "Google":
            raise MetadataError("answered without Metadata-Flavor: Google: not GCE's metadata server")
        return gce_notice(body, datetime.datetime.now(datetime.timezone.utc))


class AzureScheduledEvents(NoticeSource):
    """Azure's Scheduled Events: a ``Preempt`` event naming this VM, whose name is asked once."""

    cloud = "azure"
    api_version = "2020-07-01"
    vm_name: str | None = None  # asked at the first poll

    def _poll(self, timeout: float) -> Notice | None:
        if self.vm_name is None:
            path = f"/metadata/instance/compute/name?api-version={self.api_version}&format=text"
            name = self._ask(path, {"Metadata": "true"}, timeout)[2].decode("utf-8", "replace").strip()
            if not _AZURE_NAME.fullmatch(name):
                raise MetadataError(f"answered {name[:80]!r}, not a VM's name")
            self.vm_name = name
        path = f"/metadata/scheduledevents?api-version={self.api_version}"
        return azure_notice(self._ask(path, {"Metadata": "true"}, timeout)[2], self.vm_name)


def source(cloud: str, base_url: str | None = None) -> NoticeSource:
    """The source for ``cloud`` (one of :data:`CLOUDS`), asking ``base_url`` or the cloud's own service."""
    kinds: dict[str, type[NoticeSource]] = {"aws": AwsSpot, "gce": GcePreempted, "azure": AzureScheduledEvents}
    if cloud not in kinds:
        raise ValueError(f"no notice source for {cloud!r}; one of {', '.join(CLOUDS)}")
    return kinds[cloud](base_url)


def _shown(body: bytes) -> str:
    text = body[:200].decode("utf-8", "replace")
    return repr(text + ("..." if len(body) > 200 else ""))
