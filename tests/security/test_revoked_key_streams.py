"""Finding 10: revoking a key did not stop its running streams: a leaked key kept generating on
the sites for as long as its streams ran. Revoking now cancels each of the key's running
requests at its site; the client gets an `api_key_revoked` error, the request is recorded as
failed with what it took, and the key's next request gets 401. (Queued batch items are the
batch runner's: it can register Tenancy.add_revoke_hook.)
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.e2e.conftest import Federation

pytestmark = pytest.mark.slow
ADMIN = "admin-token-for-the-revocation-tests"


@pytest.fixture(scope="module")
def federation(start_federation) -> Federation:
    return start_federation(
        live=["aws-use1"], env={"GATEWAY_ADMIN_TOKEN": ADMIN, "GATEWAY_REQUIRE_API_KEYS": "true"}
    )


def test_revoking_a_key_cancels_its_running_stream(federation: Federation) -> None:
    admin = {"Authorization": f"Bearer {ADMIN}"}
    made = httpx.post(
        f"{federation.base_url}/admin/api/keys", json={"name": "leaked"}, headers=admin, timeout=30
    ).json()
    client = {"Authorization": f"Bearer {made['key']}"}
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    events: list[str] = []
    started = threading.Event()

    def read() -> None:
        with httpx.stream(
            "POST", f"{federation.base_url}/v1/completions", json=body, headers=client, timeout=120
        ) as stream:
            if stream.status_code != 200:
                events.append(stream.read().decode())
                started.set()
                return
            for line in stream.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert started.wait(30), "the stream never began"
    assert events[0].startswith("{"), events[0]
    revoked_at = time.monotonic()
    revoke = httpx.delete(f"{federation.base_url}/admin/api/keys/{made['id']}", headers=admin)
    assert revoke.status_code == 200, revoke.text
    reader.join(timeout=30)
    assert not reader.is_alive(), "the stream kept running after its key was revoked"
    assert time.monotonic() - revoked_at < 10
    errors = [json.loads(e)["error"] for e in events if e != "[DONE]" and "error" in json.loads(e)]
    assert errors, events[-3:]
    assert errors[-1]["code"] == "api_key_revoked", errors
    generated = sum(
        len(choice.get("text", ""))
        for e in events
        if e != "[DONE]" and "choices" in json.loads(e)
        for choice in json.loads(e)["choices"]
    )
    assert generated < 1000 * 4  # stopped well before its 1,000 tokens
    again = httpx.post(
        f"{federation.base_url}/v1/completions",
        json={**body, "stream": False},
        headers=client,
        timeout=30,
    )
    assert again.status_code == 401
