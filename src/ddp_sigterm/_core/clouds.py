"""What each cloud's metadata service says of a preemption, and how to ask it.

A source asks one cloud once per ``poll``, as its documentation specifies, and answers a :class:`Notice` or None;
pure functions read the answers, and :func:`detect_cloud` reads files, never the network. Requests go to
``base_url`` only (no proxy, no redirect, a timeout, a bounded answer); any failure raises :class:`MetadataError`
naming the cloud, the URL and what went wrong. docs/cloud-notices.md has each cloud's protocol.
"""

from __future__ import annotations

import dataclasses
import datetime
import email.utils
import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from email.message import Message
from http.client import HTTPMessage
from pathlib import Path
from typing import IO

CLOUDS = ("aws", "gce", "azure")

DEFAULT_URLS = {"aws": "http://169.254.169.254", "gce": "http://metadata.google.internal",
                "azure": "http://169.254.169.254"}
"""Each cloud's metadata service. Used only when ``notice`` names a cloud, or ``auto`` found one in this
machine's DMI data; every test gives a 127.0.0.1 URL instead."""

GCE_NOTICE_SECONDS = 30.0
"""GCE's ``preempted`` carries no time: a Spot VM has 30 s from the soft off (when it turns TRUE) to the hard off."""

KINDS = (("aws", "terminate"), ("aws", "stop"), ("aws", "hibernate"), ("gce", "preempted"), ("azure", "Preempt"))
"""Every (cloud, action) a notice can be: the stop agreement carries a notice as its index here, plus one."""

_AZURE_NAME = re.compile(r"[\w.-]{1,80}")
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
        raise MetadataError(f"spot/instance-action answered HTTP {status}")
    try:
        answer = json.loads(body)
        action, at = answer["action"], _utc(datetime.datetime.strptime(answer["time"], "%Y-%m-%dT%H:%M:%SZ"))
    except (ValueError, KeyError, TypeError) as error:
        raise MetadataError(f"spot/instance-action answered {_shown(body)}, not an interruption: {error!r}") from None
    if ("aws", action) not in KINDS:
        raise MetadataError(f"spot/instance-action answered the unknown action {action!r}")
    return Notice("aws", action, at)


def gce_notice(body: bytes, seen: datetime.datetime) -> Notice | None:
    """``instance/preempted``: ``FALSE``, or ``TRUE`` once the VM is being preempted (seen at ``seen``)."""
    text = body.decode("ascii", "replace").strip()
    if text == "FALSE":
        return None
    if text == "TRUE":
        return Notice("gce", "preempted", seen + datetime.timedelta(seconds=GCE_NOTICE_SECONDS),
                      f"{GCE_NOTICE_SECONDS:g} s after it was seen")
    raise MetadataError(f"instance/preempted answered {_shown(body)}, not TRUE or FALSE")


def azure_notice(body: bytes, vm_name: str) -> Notice | None:
    """Scheduled Events: the first ``Preempt`` event whose ``Resources`` name this VM (others are not notices)."""
    try:
        events = json.loads(body)["Events"]
        preempts = [event for event in events if event["EventType"] == "Preempt" and vm_name in event["Resources"]]
    except (ValueError, KeyError, TypeError) as error:
        raise MetadataError(f"scheduledevents answered {_shown(body)}, not a list of events: {error!r}") from None
    if not preempts:
        return None
    event = preempts[0]
    not_before = event.get("NotBefore") or ""  # empty once the event has started
    try:
        at = _utc(email.utils.parsedate_to_datetime(not_before)) if not_before else None
    except (ValueError, TypeError):
        raise MetadataError(f"scheduledevents answered the NotBefore {not_before!r}, not an RFC 1123 time") from None
    return Notice("azure", "Preempt", at, f"EventId {event.get('EventId', '?')}")


def detect_cloud(sysfs: Path = Path("/sys")) -> str | None:
    """The cloud this machine runs in, from files under ``sysfs`` alone (no network): ``aws``, ``gce``, ``azure``
    or None (no cloud, or no DMI data). The marks are cloud-init's (docs/cloud-notices.md)."""

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


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req: urllib.request.Request, fp: IO[bytes], code: int, msg: str,
                         headers: HTTPMessage, newurl: str) -> None:
        return None  # the redirect's own answer (3xx) is then an error: nothing goes past base_url


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())


def _request(cloud: str, method: str, url: str, headers: Mapping[str, str],
             timeout: float) -> tuple[int, Message, bytes]:
    """``(status, headers, body)`` of one request; HTTP errors are answers too, anything else a MetadataError."""
    request = urllib.request.Request(url, method=method, headers=dict(headers))  # noqa: S310 (http only: NoticeSource)
    try:
        with _OPENER.open(request, timeout=timeout) as response:
            return response.status, response.headers, response.read(_MAX_ANSWER)
    except urllib.error.HTTPError as answer:
        with answer:
            return answer.code, answer.headers, answer.read(_MAX_ANSWER)
    except (OSError, ValueError) as error:  # URLError, timeouts, a connection refused or reset
        raise MetadataError(f"{cloud}: {method} {url} failed: {error}") from error


class NoticeSource:
    """Asks one cloud's metadata service at ``base_url`` (or the cloud's own; ``http://`` only)."""

    cloud = ""

    def __init__(self, base_url: str | None = None) -> None:
        url = (base_url or DEFAULT_URLS[self.cloud]).rstrip("/")
        if not url.startswith("http://"):
            raise ValueError(f"the {self.cloud} metadata service's URL must start with http://, got {url!r}")
        self.base_url = url

    def poll(self, timeout: float) -> Notice | None:
        """Ask once, each request within ``timeout`` s: the notice, None if none yet, or :class:`MetadataError`."""
        raise NotImplementedError


class AwsSpot(NoticeSource):
    """EC2's spot interruption notice through IMDSv2 (a session token, renewed before it lapses or after a 401),
    or IMDSv1 where no token can be had."""

    cloud = "aws"
    _token: tuple[str, float] | None = None  # the token and when (time.monotonic()) to renew it
    _no_token = ""  # why the last token request failed

    def poll(self, timeout: float) -> Notice | None:
        url = f"{self.base_url}/latest/meta-data/spot/instance-action"
        status, _, body = _request(self.cloud, "GET", url, self._headers(timeout), timeout)
        if status == 401 and self._token is not None:  # the token lapsed or was revoked: once more with a new one
            self._token = None
            status, _, body = _request(self.cloud, "GET", url, self._headers(timeout), timeout)
        if status == 401:
            raise MetadataError(f"aws: GET {url} answered 401 (the instance requires IMDSv2) and the session token "
                                f"could not be had ({self._no_token}): in a container, the instance's metadata hop "
                                "limit must be 2 or more")
        try:
            return aws_notice(status, body)
        except MetadataError as error:
            raise MetadataError(f"aws: GET {url}: {error}") from None

    def _headers(self, timeout: float) -> dict[str, str]:
        """The token's header, asking for a token if none is fresh; no header (IMDSv1) if none can be had."""
        if self._token is None or time.monotonic() >= self._token[1]:
            self._token = None
            url = f"{self.base_url}/latest/api/token"
            try:
                status, _, body = _request(self.cloud, "PUT", url,
                                           {"X-aws-ec2-metadata-token-ttl-seconds": str(_AWS_TOKEN_SECONDS)}, timeout)
            except MetadataError as error:
                self._no_token = str(error)
                return {}
            if status != 200 or not body.strip():
                self._no_token = f"PUT {url} answered HTTP {status}"
                return {}
            self._token = body.decode("ascii", "replace").strip(), time.monotonic() + _AWS_TOKEN_SECONDS - 60
        return {"X-aws-ec2-metadata-token": self._token[0]}


class GcePreempted(NoticeSource):
    """GCE's ``instance/preempted``, with ``Metadata-Flavor: Google`` asked and required in the answer."""

    cloud = "gce"

    def poll(self, timeout: float) -> Notice | None:
        url = f"{self.base_url}/computeMetadata/v1/instance/preempted"
        status, headers, body = _request(self.cloud, "GET", url, {"Metadata-Flavor": "Google"}, timeout)
        if status != 200:
            raise MetadataError(f"gce: GET {url} answered HTTP {status}: {_shown(body)}")
        if headers.get("Metadata-Flavor") != "Google":
            raise MetadataError(f"gce: GET {url} answered without Metadata-Flavor: Google: not GCE's metadata server")
        try:
            return gce_notice(body, datetime.datetime.now(datetime.timezone.utc))
        except MetadataError as error:
            raise MetadataError(f"gce: GET {url}: {error}") from None


class AzureScheduledEvents(NoticeSource):
    """Azure's Scheduled Events: a ``Preempt`` event naming this VM, whose name is asked once."""

    cloud = "azure"
    api_version = "2020-07-01"
    vm_name: str | None = None  # asked at the first poll

    def poll(self, timeout: float) -> Notice | None:
        if self.vm_name is None:
            path = f"/metadata/instance/compute/name?api-version={self.api_version}&format=text"
            name = self._get(path, timeout).decode("utf-8", "replace").strip()
            if not _AZURE_NAME.fullmatch(name):  # letters, digits, _ . - (a scale set's instance: <set>_<id>)
                raise MetadataError(f"azure: GET {self.base_url}{path} answered {name[:80]!r}, not a VM's name")
            self.vm_name = name
        path = f"/metadata/scheduledevents?api-version={self.api_version}"
        try:
            return azure_notice(self._get(path, timeout), self.vm_name)
        except MetadataError as error:
            raise MetadataError(f"azure: GET {self.base_url}{path}: {error}") from None

    def _get(self, path: str, timeout: float) -> bytes:
        url = f"{self.base_url}{path}"
        status, _, body = _request(self.cloud, "GET", url, {"Metadata": "true"}, timeout)
        if status != 200:
            raise MetadataError(f"azure: GET {url} answered HTTP {status}: {_shown(body)}")
        return body


def source(cloud: str, base_url: str | None = None) -> NoticeSource:
    """The source for ``cloud`` (one of :data:`CLOUDS`), asking ``base_url`` or the cloud's own service."""
    kinds: dict[str, type[NoticeSource]] = {"aws": AwsSpot, "gce": GcePreempted, "azure": AzureScheduledEvents}
    if cloud not in kinds:
        raise ValueError(f"no notice source for {cloud!r}; one of {', '.join(CLOUDS)}")
    return kinds[cloud](base_url)


def _utc(moment: datetime.datetime) -> datetime.datetime:
    return moment.replace(tzinfo=datetime.timezone.utc) if moment.tzinfo is None else moment


def _shown(body: bytes) -> str:
    text = body[:200].decode("utf-8", "replace")
    return repr(text + ("..." if len(body) > 200 else ""))
