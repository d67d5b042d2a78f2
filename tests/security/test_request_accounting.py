"""Issue 48, findings 1 and 3: what a request holds and is billed when it does not end as asked.

Finding 1: a non-streaming client that went away was not cancelled. Streams were; a plain
request whose client closed after 3 s generated 2,000 tokens for ~6 minutes at its site, was
billed in full and held its key's concurrency slot meanwhile (429s); an `n: 8` request ran to
the request timeout. Now the answer is cancelled at its site once its client has gone, on both
site kinds (our gRPC engine, and a site of kind `openai`), for completions, chat with n > 1 and
prompt lists: recorded `cancelled` with the tokens generated so far, its key's slot back at once.

Finding 3: a prompt list refused partway (its second prompt over the key's requests per minute)
left the prompts admitted before it `dispatched` forever, counted in usage and in the budget,
and with a concurrency cap of 1 a prompt list could never succeed. Now a list is one request to
its key: one of its requests per minute, one concurrency slot, every prompt's tokens charged
together; admitted whole or not at all. A stream of a list whose client leaves records the
prompts it never reached as cancelled.

Real processes on loopback: a gRPC site engine with its gateway, and a site engine reached
through its OpenAI-compatible HTTP face as a site of kind `openai`, with a gateway of its own.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from devtools.launch import ManagedProcess, free_port, spawn_site, start_gateway, wait_until_serving
from tests.e2e.conftest import Federation, wait_until_written
from tests.support.api_keys import make_key

pytestmark = pytest.mark.slow
ADMIN = "admin-token-for-the-accounting-tests"
ENV = {"GATEWAY_ADMIN_TOKEN": ADMIN, "GATEWAY_REQUIRE_API_KEYS": "true"}
# ~9 s of generation on the tiny model here (~110 tokens/s for one answer); the client leaves
# after LEAVE_S, long before it ends.
MAX_TOKENS = 1000
LONG = {"model": "tiny", "prompt": "Hi", "max_tokens": MAX_TOKENS, "ignore_eos": True}
LEAVE_S = 1.5
# How long the site may keep generating once the client has gone (load reports come every
# 250 ms, an openai site's metrics every 200 ms).
STOPPED_WITHIN_S = 5.0


@dataclass(frozen=True)
class Gateway:
    base_url: str
    database_url: str
    site: str

    def query(self, sql: str, **params: object) -> list[tuple[object, ...]]:
        from sqlalchemy import create_engine, text

        from gateway.db.migrate import sync_url

        wait_until_written(self.base_url)
        engine = create_engine(sync_url(self.database_url))
        try:
            with engine.connect() as connection:
                return [tuple(row) for row in connection.execute(text(sql), params)]
        finally:
            engine.dispose()

    def rows(self, key_name: str) -> list[tuple[object, ...]]:
        """(status, completion_tokens, error) of the key's requests, oldest first."""
        return self.query(
            "SELECT r.status, r.completion_tokens, r.error FROM requests r "
            "JOIN api_keys k ON k.id = r.api_key_id WHERE k.name = :name ORDER BY r.created_at",
            name=key_name,
        )

    def key(self, name: str, **limits: int) -> dict[str, str]:
        return {"Authorization": f"Bearer {make_key(self.base_url, ADMIN, name, **limits)}"}

    def busy(self) -> float:
        """Requests running or waiting at the gateway's site, as the site last reported."""
        exposition = httpx.get(
            f"{self.base_url}/metrics", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10
        ).text
        pattern = re.compile(
            r'^fedllm_gateway_site_(?:running|queued)_requests\{[^}]*site="'
            + re.escape(self.site)
            + r'"[^}]*\} (\S+)$',
            re.M,
        )
        return sum(float(value) for value in pattern.findall(exposition))


@pytest.fixture(scope="module")
def grpc_gateway(start_federation) -> Gateway:
    federation: Federation = start_federation(live=["aws-use1"], env=ENV)
    return Gateway(federation.base_url, federation.database_url, "aws-use1")


@pytest.fixture(scope="module")
def openai_gateway(tiny_llama_dir, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    work = tmp_path_factory.mktemp("openai-kind")
    http_port = free_port()
    started: list[ManagedProcess] = []
    try:
        site = spawn_site(model_dir=tiny_llama_dir, site_name="engine-b", model_name="tiny",
                          log_dir=work, extra_args=["--http-port", str(http_port)])  # fmt: skip
        started.append(site)
        wait_until_serving(site)
        base = f"http://127.0.0.1:{http_port}"
        federation = {
            "models": [{"name": "tiny", "tokenizer": str(tiny_llama_dir)}],
            "sites": [
                {
                    "name": "openai-b",
                    "cloud": "gcp",
                    "region": "europe-west4",
                    "model": "tiny",
                    "kind": "openai",
                    "base_url": f"{base}/v1",
                    "engine_model": "tiny",
                    "metrics_url": f"{base}/metrics",
                    "metrics_dialect": "vllm",
                    "metrics_interval_ms": 200,
                }
            ],
        }
        path = work / "federation.json"
        path.write_text(json.dumps(federation))
        database_url = f"sqlite+aiosqlite:///{work / 'gateway.db'}"
        gateway = start_gateway(
            federation_file=path, database_url=database_url, log_dir=work, env=ENV
        )
        started.append(gateway)
        yield Gateway(f"http://127.0.0.1:{gateway.port}", database_url, "openai-b")
    finally:
        for process in reversed(started):
            process.stop()


def leave_early(gateway: Gateway, path: str, body: dict[str, object], headers: dict[str, str]):
    """Sends a plain (non-streaming) request and goes away LEAVE_S later, its answer unread."""
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{gateway.base_url}{path}",
            json=body,
            headers=headers,
            timeout=httpx.Timeout(LEAVE_S, connect=30),
        )


def assert_site_stops(gateway: Gateway) -> None:
    deadline = time.monotonic() + STOPPED_WITHIN_S
    while (busy := gateway.busy()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert busy == 0, f"{gateway.site} still generating {STOPPED_WITHIN_S}s after the client left"


def assert_cancelled(rows: list[tuple[object, ...]], prompts: int, most: int) -> None:
    """Each prompt's row: cancelled as its client went away, billed what it generated."""
    assert len(rows) == prompts, rows
    for status, completion_tokens, error in rows:
        assert (status, error) == ("cancelled", "client went away"), rows
        assert isinstance(completion_tokens, int)
        assert 0 <= completion_tokens < most, rows


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True}
# (path, body, prompts, the most one prompt may generate)
CASES = {
    "completion": ("/v1/completions", LONG, 1, MAX_TOKENS),
    "chat, n=4": ("/v1/chat/completions", {**CHAT, "n": 4, "max_tokens": 300}, 1, 4 * 300),
    "a list of 3 prompts": ("/v1/completions", {**LONG, "prompt": ["Hi", "Yo", "Hm"]}, 3, 1000),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_plain_request_whose_client_left_is_cancelled(grpc_gateway: Gateway, case: str) -> None:
    path, body, prompts, most = CASES[case]
    name = f"gone {case}"
    headers = grpc_gateway.key(name, max_concurrent_requests=1)
    leave_early(grpc_gateway, path, body, headers)
    assert_site_stops(grpc_gateway)
    # The key's only slot is back: before, 429 concurrency_limit_exceeded until the answer ended.
    again = httpx.post(f"{grpc_gateway.base_url}/v1/completions",
                       json={**LONG, "max_tokens": 2}, headers=headers, timeout=60)  # fmt: skip
    assert again.status_code == 200, again.text
    rows = grpc_gateway.rows(name)
    assert_cancelled(rows[:-1], prompts, most)
    assert sum(int(str(row[1])) for row in rows[:-1]) > 0  # what was generated is billed
    assert rows[-1][0] == "completed"


@pytest.mark.parametrize("case", ["completion", "chat, n=4"])
def test_an_openai_kind_site_cancels_its_upstream_request(
    openai_gateway: Gateway, case: str
) -> None:
    path, body, prompts, most = CASES[case]
    name = f"gone upstream {case}"
    headers = openai_gateway.key(name, max_concurrent_requests=1)
    leave_early(openai_gateway, path, body, headers)
    assert_site_stops(openai_gateway)
    again = httpx.post(f"{openai_gateway.base_url}/v1/completions",
                       json={**LONG, "max_tokens": 2}, headers=headers, timeout=60)  # fmt: skip
    assert again.status_code == 200, again.text
    assert_cancelled(openai_gateway.rows(name)[:-1], prompts, most)


def complete(gateway: Gateway, headers: dict[str, str], **body: object) -> httpx.Response:
    return httpx.post(
        f"{gateway.base_url}/v1/completions",
        json={"model": "tiny", "max_tokens": 4, "ignore_eos": True, **body},
        headers=headers,
        timeout=120,
    )


PROMPTS = ["Hi", "Yo", "Hm"]


def test_a_prompt_list_is_one_request_to_its_keys_limits(grpc_gateway: Gateway) -> None:
    """One of the key's requests per minute, and one concurrency slot: before, its second
    prompt was refused (429) and its first left `dispatched` forever."""
    headers = grpc_gateway.key("list rpm", requests_per_minute=1, max_concurrent_requests=1)
    answer = complete(grpc_gateway, headers, prompt=PROMPTS)
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["choices"]) == 3
    refused = complete(grpc_gateway, headers, prompt=PROMPTS)
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["type"] == "requests"
    rows = grpc_gateway.rows("list rpm")
    assert [row[:2] for row in rows] == [("completed", 4)] * 3  # the refused list left none


def test_a_prompt_list_is_charged_its_prompts_together(grpc_gateway: Gateway) -> None:
    """Three prompts whose tokens together exceed the key's minute are refused whole, as one
    request too large (no Retry-After: it never fits); before, two were admitted and left
    `dispatched` and the third refused."""
    probe = complete(grpc_gateway, grpc_gateway.key("list probe"), prompt="Hi")
    per_prompt = probe.json()["usage"]["total_tokens"]  # ignore_eos: prompt + max_tokens
    headers = grpc_gateway.key("list tpm", tokens_per_minute=2 * per_prompt + 1)
    refused = complete(grpc_gateway, headers, prompt=PROMPTS)
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["type"] == "tokens"
    assert "retry-after" not in refused.headers
    assert grpc_gateway.rows("list tpm") == []
    fits = complete(grpc_gateway, headers, prompt=PROMPTS[:2])
    assert fits.status_code == 200, fits.text


def test_a_streamed_prompt_list_whose_client_left_records_every_prompt(
    grpc_gateway: Gateway,
) -> None:
    """The client leaves during the first prompt's stream: the prompts it never reached are
    recorded cancelled with nothing generated (before: `dispatched` forever)."""
    headers = grpc_gateway.key("list stream")
    body = {**LONG, "prompt": PROMPTS, "stream": True}
    url = f"{grpc_gateway.base_url}/v1/completions"
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as stream:
        assert stream.status_code == 200
        next(stream.iter_bytes())  # the first prompt's answer has begun; then the client goes
    assert_site_stops(grpc_gateway)
    rows = grpc_gateway.rows("list stream")
    assert [row[0] for row in rows] == ["cancelled"] * 3, rows
    assert sorted(int(str(row[1])) for row in rows)[:2] == [0, 0]  # the two never reached


def send_and_leave(gateway: Gateway, path: str, body: dict[str, object], auth: str) -> None:
    """Sends a request on a raw socket and closes the connection as soon as the gateway has its
    body, before its answer begins. `Expect: 100-continue` makes the gateway say when its handler
    reads the body (uvicorn writes `100 Continue` then), so the body is read, and the client
    gone while the request is prepared and dispatched: its streaming answer is never started."""
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(gateway.base_url)
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: {auth}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
        "Expect: 100-continue\r\n\r\n"
    ).encode()
    with socket.create_connection((url.hostname, url.port), timeout=30) as connection:
        connection.sendall(head)
        assert connection.recv(64).startswith(b"HTTP/1.1 100"), "the body was never asked for"
        connection.sendall(payload)
    # closed: the FIN follows the body at once


# Over 1 KiB of body: the request is tokenized on a pool thread (gateway/tokenize_pool.py), so
# its handler waits once, and the gateway sees the connection close before it answers.
WORDY = "Hi " * 370
SHORT = {**LONG, "max_tokens": 50, "stream": True}
STREAMS = {
    "completion": ("/v1/completions", {**SHORT, "prompt": WORDY}, 1),
    "chat": (
        "/v1/chat/completions",
        {
            **CHAT,
            "messages": [{"role": "user", "content": WORDY}],
            "max_tokens": 50,
            "stream": True,
        },
        1,
    ),
    "response": ("/v1/responses", {"model": "tiny", "input": WORDY, "stream": True}, 1),
    "a list of 3 prompts": (
        "/v1/completions",
        {**SHORT, "prompt": [WORDY[:400]] * 3},
        3,
    ),
}


@pytest.mark.parametrize("case", list(STREAMS))
def test_a_stream_whose_client_left_before_it_began_is_cancelled(
    grpc_gateway: Gateway, case: str
) -> None:
    """The client leaves after its request was admitted and recorded but before the server
    began its streaming answer: the answer's iterator is never run, so nothing of it ended the
    request. Before, its row stayed `dispatched` forever (never billed as cancelled); now it is
    recorded cancelled with nothing generated and its key's slot is back."""
    path, body, prompts = STREAMS[case]
    name = f"stream never began {case}"
    headers = grpc_gateway.key(name, max_concurrent_requests=1)
    send_and_leave(grpc_gateway, path, body, headers["Authorization"])
    deadline = time.monotonic() + STOPPED_WITHIN_S
    while len(rows := grpc_gateway.rows(name)) < prompts or any(
        row[0] == "dispatched" for row in rows
    ):
        assert time.monotonic() < deadline, f"still not ended: {rows}"
        time.sleep(0.2)
    assert [row[:2] for row in rows] == [("cancelled", 0)] * prompts, rows
    assert rows[0][2] == "client went away", rows
    again = httpx.post(f"{grpc_gateway.base_url}/v1/completions",
                       json={**LONG, "max_tokens": 2}, headers=headers, timeout=60)  # fmt: skip
    assert again.status_code == 200, again.text
