"""Issue 32, findings 4 and 5: connections that hold the gateway without sending.

4. Upload slots: two keys sending a multipart upload's headers and no body held every
   `POST /v1/files` and `POST /v1/batches` slot (a key could take half of them) for as long as
   the connections stayed open: every other key's uploads got 429 (40 s+, no timeout).
5. Idle connections: a connection that sends nothing, or headers a line at a time, was never
   closed (75 s+; 2,000 held).

Issue 48, finding 4: four keys re-stalling header-only uploads held the gateway's four upload
slots: a fifth key got 429 for as long as they kept at it. Now only validating counts against
the gateway's GATEWAY_BATCH_UPLOADS_IN_FLIGHT; a body being received holds only its key's
share (GATEWAY_BATCH_UPLOADS_PER_KEY), so one key's stalls never refuse another key.

Issue 48, finding 2: request headers had no size bound: one 80 MiB header was answered 200,
and eight of 47 MiB took the gateway from 351 to 766 MiB. Now a request line and its headers
take at most GATEWAY_MAX_HEADER_BYTES (64 KiB): past it 431 before the rest is read.

Raw sockets against a real gateway. A key now holds one upload at a time (2 keys, 4 slots:
another key still uploads); a body must keep arriving (GATEWAY_BODY_TIMEOUT_S, then at least
GATEWAY_BODY_MIN_BYTES_PER_S): the slow senders get 408 and their slots come back; a
connection's request headers must be complete within GATEWAY_HEADER_TIMEOUT_S (408), and a
connection with no request in progress is closed after GATEWAY_KEEP_ALIVE_TIMEOUT_S of silence.
"""

from __future__ import annotations

import io
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import Federation
from tests.security.batch_keys import KEYS_REQUIRED, make_key

pytestmark = pytest.mark.slow
# Short bounds, so that the test waits seconds; the assertions only need the connection to end.
HEADER_S, KEEP_ALIVE_S, BODY_S = 2, 1, 2
# A connection the gateway never closes is seen open after this long (the bounds are far below).
GIVE_UP_S = 30


@pytest.fixture(scope="module")
def federation(start_federation) -> Federation:
    return start_federation(
        live=["aws-use1"],
        env={
            **KEYS_REQUIRED,
            "GATEWAY_HEADER_TIMEOUT_S": str(HEADER_S),
            "GATEWAY_KEEP_ALIVE_TIMEOUT_S": str(KEEP_ALIVE_S),
            "GATEWAY_BODY_TIMEOUT_S": str(BODY_S),
        },
    )


def _connect(federation: Federation) -> socket.socket:
    return socket.create_connection(("127.0.0.1", federation.gateway.port), timeout=GIVE_UP_S)


def _ending(sock: socket.socket) -> tuple[str, bytes]:
    """How the gateway ends the connection ("closed" or "reset"), with what it sent first;
    ("open", ...) if it is still open after GIVE_UP_S."""
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        return "reset", received
    except TimeoutError:
        return "open", received
    return "closed", received


@contextmanager
def _stalled_upload(federation: Federation, key: str) -> Iterator[socket.socket]:
    """An upload whose headers promise a body that never comes."""
    sock = _connect(federation)
    head = (
        "POST /v1/files HTTP/1.1\r\nHost: gateway\r\n"
        f"Authorization: Bearer {key}\r\n"
        "Content-Type: multipart/form-data; boundary=xyz\r\nContent-Length: 100000\r\n\r\n"
    )
    sock.sendall(head.encode())
    try:
        yield sock
    finally:
        sock.close()


def _upload(federation: Federation, key: str) -> httpx.Response:
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": "x", "max_tokens": 1}}  # fmt: skip
    return httpx.post(
        f"{federation.base_url}/v1/files",
        files={"file": ("in.jsonl", io.BytesIO(json.dumps(line).encode()))},
        data={"purpose": "batch"},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )


def _wait_for_upload_slot(federation: Federation, key: str) -> None:
    """The previous test's stalled uploads have ended (408) and given their slots back."""
    deadline = time.monotonic() + GIVE_UP_S
    while (answer := _upload(federation, key)).status_code == 429:
        assert time.monotonic() < deadline, answer.text
        time.sleep(0.2)


def test_slow_uploads_of_two_keys_leave_other_keys_their_uploads(federation: Federation) -> None:
    attackers = [make_key(federation, f"stall-{n}")["key"] for n in range(2)]
    victim = make_key(federation, "victim")["key"]
    with ExitStack() as stack:
        stalled = [
            stack.enter_context(_stalled_upload(federation, key))
            for key in attackers
            for _ in range(2)
        ]
        time.sleep(0.5)  # not a synchronisation: the victim's upload must succeed either way
        answer = _upload(federation, victim)
        assert answer.status_code == 200, answer.text
        # The slow bodies are cut: 408 in the OpenAI shape, then the connection closes.
        endings = [_ending(sock) for sock in stalled]
    answered = [received for how, received in endings if how == "closed" and received]
    assert any(b" 408 " in received.split(b"\r\n", 1)[0] for received in answered), endings
    assert all(how != "open" for how, _ in endings), endings
    for key in attackers:  # their slots came back
        _wait_for_upload_slot(federation, key)


def test_stalled_uploads_of_as_many_keys_as_slots_leave_another_key_its_upload(
    federation: Federation,
) -> None:
    attackers = [make_key(federation, f"restall-{n}")["key"] for n in range(4)]  # the default
    victim = make_key(federation, "fifth")["key"]
    with ExitStack() as stack:
        stalled = [stack.enter_context(_stalled_upload(federation, key)) for key in attackers]
        # Each stall is under way once its key's next upload is refused ...
        refused = [_upload(federation, key) for key in attackers]
        assert [answer.status_code for answer in refused] == [429] * 4
        answer = _upload(federation, victim)  # ... and none of them is the fifth key's
        assert answer.status_code == 200, answer.text
        assert all("this key has 1 batch upload" in a.json()["error"]["message"] for a in refused)
        for sock in stalled:
            sock.close()
    for key in attackers:
        _wait_for_upload_slot(federation, key)


def test_a_silent_connection_is_closed(federation: Federation) -> None:
    sock = _connect(federation)
    how, received = _ending(sock)
    assert (how, received) == ("closed", b"")


def test_headers_sent_a_line_at_a_time_get_408(federation: Federation) -> None:
    sock = _connect(federation)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\n")
    sock.settimeout(1)
    started = time.monotonic()
    ended = None
    while time.monotonic() - started < GIVE_UP_S:
        try:
            sock.sendall(b"X-Trickle: 1\r\n")  # each line under the keep-alive bound
        except OSError:
            break
        try:
            ended = sock.recv(65536)
            break
        except TimeoutError:
            continue
    assert ended is not None, "still open"
    assert ended.startswith(b"HTTP/1.1 408 "), ended


def test_an_idle_keep_alive_connection_is_closed(federation: Federation) -> None:
    sock = _connect(federation)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\n\r\n")
    sock.settimeout(GIVE_UP_S)
    first = sock.recv(65536)
    assert first.startswith(b"HTTP/1.1 200 "), first
    how, _ = _ending(sock)
    assert how == "closed"


def test_many_silent_connections_all_close_and_the_gateway_serves_meanwhile(
    federation: Federation,
) -> None:
    socks = [_connect(federation) for _ in range(300)]
    try:
        healthy = httpx.get(f"{federation.base_url}/healthz", timeout=10)
        assert healthy.status_code == 200
        assert all(_ending(sock)[0] == "closed" for sock in socks)
    finally:
        for sock in socks:
            sock.close()


def _peak_memory_kib(pid: int) -> int:
    """The process's resident memory at its highest so far (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmHWM for {pid}")


def test_headers_past_the_bound_get_431_before_they_end(federation: Federation) -> None:
    under = httpx.get(f"{federation.base_url}/healthz", headers={"X-Fill": "a" * 60_000})
    assert under.status_code == 200, under.text
    with _connect(federation) as sock:
        # 256 KiB of one header and no end to it: refused once 64 KiB are in.
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\nX-Fill: " + b"a" * (256 << 10))
        how, received = _ending(sock)
    assert how == "closed", (how, received[:200])
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 "), received[:200]
    assert json.loads(body)["error"]["code"] == "headers_too_large"
    # A body is no header: 300 KB of one, then a second request, all in one send, both served.
    with _connect(federation) as sock:
        large = b"a" * 300_000
        sock.sendall(
            b"POST /healthz HTTP/1.1\r\nHost: gateway\r\nContent-Length: %d\r\n\r\n%s"
            b"GET /healthz HTTP/1.1\r\nHost: gateway\r\nConnection: close\r\n\r\n"
            % (len(large), large)
        )
        how, received = _ending(sock)
    statuses = re.findall(rb"HTTP/1\.1 (\d{3}) ", received)
    assert (how, statuses) == ("closed", [b"405", b"200"]), received[:300]


def test_huge_headers_are_not_held_in_memory(federation: Federation) -> None:
    """The issue's eight 47 MiB headers grew the gateway by 415 MiB; here eight of 32 MiB."""
    pid = federation.gateway.popen.pid
    before = _peak_memory_kib(pid)
    request = b"GET /healthz HTTP/1.1\r\nHost: gateway\r\nX-Fill: " + b"a" * (32 << 20)
    endings: list[tuple[str, bytes]] = []

    def send_huge_headers() -> None:
        with _connect(federation) as sock:
            with suppress(OSError):  # refused and closed while it was still sending
                sock.sendall(request + b"\r\n\r\n")
            endings.append(_ending(sock))

    senders = [threading.Thread(target=send_huge_headers) for _ in range(8)]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join()
    grown_mib = (_peak_memory_kib(pid) - before) / 1024
    assert grown_mib < 16, f"the gateway's peak memory grew {grown_mib:.0f} MiB"
    assert all(how != "open" for how, _ in endings), endings
    assert not any(received.startswith(b"HTTP/1.1 200 ") for _, received in endings)
    assert httpx.get(f"{federation.base_url}/healthz", timeout=10).status_code == 200
