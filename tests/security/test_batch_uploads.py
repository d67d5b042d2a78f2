"""Finding 3 (batches): a batch's items were tokenized on the event loop (yielding only every
256 items), so one batch of large prompts stalled every stream and `/healthz`; an item could be
as large as the whole batch body (64 MiB); and any number of batch uploads could be received
and validated at once, each held in memory.

Now every item is validated on the tokenize pool, a bounded slice at a time; an item is at most
GATEWAY_MAX_BODY_BYTES (the body limit of the endpoint it names), refused before it is
tokenized; and a key has at most GATEWAY_BATCH_UPLOADS_PER_KEY uploads under way (429 beyond;
issue 32 made it one), the gateway validating at most GATEWAY_BATCH_UPLOADS_IN_FLIGHT of them
at once (since issue 48 that bound no longer counts bodies being received: see
test_connection_deadlines.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.conftest import Federation
from tests.security.batch_keys import KEYS_REQUIRED, client_of, make_key
from tests.security.healthz_probe import probing_healthz

pytestmark = pytest.mark.slow
# Near 1 MB: under the 1 MiB item limit, far over the tiny model's 1,024-token context.
LARGE = "word " * 190_000


@pytest.fixture(scope="module")
def federation(start_federation) -> Federation:
    return start_federation(
        live=["aws-use1"],
        env={
            **KEYS_REQUIRED,
            # Prompts this long are tokenized (then refused on their tokens), not refused early.
            "GATEWAY_MAX_PROMPT_CHARS_PER_TOKEN": "10000",
            "GATEWAY_BATCH_UPLOADS_IN_FLIGHT": "2",
        },
    )


def test_a_batch_of_large_items_does_not_stall_the_gateway(federation: Federation) -> None:
    key = make_key(federation, "large")
    items = [{"custom_id": f"l{i}", "prompt": LARGE, "max_tokens": 1} for i in range(6)]
    gateway_pid = federation.gateway.popen.pid
    with (
        probing_healthz(federation.base_url, server_pid=gateway_pid) as probe,
        client_of(federation, key) as client,
    ):
        answer = client.post("/v1/batches", json={"model": "tiny", "requests": items})
        worst_s = probe.worst_s
        assert answer.status_code == 200, answer.text[:300]
        # Each item is refused as /v1/completions would refuse it (OpenAI: that line's error).
        assert answer.json()["request_counts"]["failed"] == 6
        results = client.get(f"/v1/batches/{answer.json()['id']}/results").json()["data"]
    for result in results:
        assert result["error"]["code"] == "context_length_exceeded"
        assert "tokens" in result["error"]["message"]  # tokenized, then refused
    assert worst_s < 0.5, f"/healthz took {worst_s:.2f} s while the batch was validated"


def test_an_item_larger_than_a_request_is_refused_before_tokenizing(
    federation: Federation,
) -> None:
    key = make_key(federation, "huge-item")
    huge = {"custom_id": "h", "prompt": "word " * 220_000, "max_tokens": 1}  # 1.1 MB
    with client_of(federation, key) as client:
        answer = client.post("/v1/batches", json={"model": "tiny", "requests": [huge]})
    assert answer.status_code == 400, answer.text[:300]
    error = answer.json()["error"]
    assert (error["code"], error["param"]) == ("request_too_large", "requests[0]")


def test_a_key_has_one_batch_upload_under_way(federation: Federation) -> None:
    first, second = make_key(federation, "slow-1"), make_key(federation, "slow-2")
    body = b'{"model": "tiny", "requests": [{"custom_id": "a", "prompt": "x", "max_tokens": 1}]}'
    release = threading.Event()
    answers: list[httpx.Response] = []

    def slow_body() -> Iterator[bytes]:
        yield body[:20]
        release.wait(30)
        yield body[20:]

    def slow_upload() -> None:
        with client_of(federation, first) as client:
            answers.append(
                client.post(
                    "/v1/batches", content=slow_body(), headers={"content-type": "application/json"}
                )
            )

    uploader = threading.Thread(target=slow_upload)
    uploader.start()
    try:
        time.sleep(1.0)  # the slow upload holds its slot while its body trickles in
        with client_of(federation, first) as client:
            again = client.post("/v1/batches", content=body)
        assert again.status_code == 429, again.text
        assert again.json()["error"]["code"] == "gateway_overloaded"
        assert again.headers["retry-after"]
        with client_of(federation, second) as client:  # another key has its own share
            other = client.post("/v1/batches", content=body)
        assert other.status_code == 200, other.text
    finally:
        release.set()
        uploader.join()
    assert answers[0].status_code == 200, answers[0].text
