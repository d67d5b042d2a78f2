"""Finding 12: limits were per process, not per deployment. A deployment runs several gateway
replicas behind its load balancer; each counted a key's requests, tokens and requests in flight
alone, so a client spreading its requests over N replicas got N times its limits, and a
password guesser N times the admin login attempts.

Two real gateways on one PostgreSQL database, one site: a key's requests per minute, tokens per
minute and concurrency cap hold over both together, and so does the login throttle.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from devtools.launch import ManagedProcess, start_gateway
from gateway.db.migrate import downgrade
from tests.e2e.conftest import Federation
from tests.support.api_keys import make_key

pytestmark = [pytest.mark.slow, pytest.mark.postgres]
ADMIN = "admin-token-for-the-replica-tests"
ENV = {"GATEWAY_ADMIN_TOKEN": ADMIN, "GATEWAY_REQUIRE_API_KEYS": "true"}


@dataclass(frozen=True)
class Replicas:
    urls: tuple[str, str]

    def complete(self, replica: int, key: str, **body: object) -> httpx.Response:
        return httpx.post(
            f"{self.urls[replica]}/v1/completions",
            json={"model": "tiny", "prompt": "Hi", "max_tokens": 1, **body},
            headers={"Authorization": f"Bearer {key}"},
            timeout=120,
        )


@pytest.fixture(scope="module")
def replicas(
    start_federation, postgres_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Replicas]:
    first: Federation = start_federation(live=["aws-use1"], database_url=postgres_url, env=ENV)
    second: ManagedProcess | None = None
    try:
        second = start_gateway(
            federation_file=first.gateway.log_path.parent / "federation.json",
            database_url=postgres_url,
            log_dir=tmp_path_factory.mktemp("second"),
            env=ENV,
        )
        yield Replicas((first.base_url, f"http://127.0.0.1:{second.port}"))
    finally:
        if second is not None:
            second.stop()
        first.gateway.stop()
        downgrade(postgres_url)  # the session's database is shared: leave it empty


def statuses(answers: list[httpx.Response]) -> list[int]:
    return [answer.status_code for answer in answers]


def test_a_keys_requests_per_minute_hold_over_both_replicas(replicas: Replicas) -> None:
    key = make_key(replicas.urls[0], ADMIN, "rpm", requests_per_minute=4)
    answers = [replicas.complete(n % 2, key) for n in range(8)]
    assert statuses(answers) == [200] * 4 + [429] * 4, [a.text[:200] for a in answers]
    refused = answers[-1].json()["error"]
    assert (refused["type"], refused["code"]) == ("requests", "rate_limit_exceeded")
    # The first of the four counts for a minute after its second (whenever in a clock minute
    # they came: the window slides by the second).
    assert 1 <= int(answers[-1].headers["retry-after"]) <= 61


def test_a_keys_tokens_per_minute_hold_over_both_replicas(replicas: Replicas) -> None:
    probe = make_key(replicas.urls[0], ADMIN, "probe")
    prompt_tokens = replicas.complete(0, probe).json()["usage"]["prompt_tokens"]
    per_request = prompt_tokens + 8  # ignore_eos: charged and settled at prompt + max_tokens
    key = make_key(replicas.urls[0], ADMIN, "tpm", tokens_per_minute=3 * per_request)
    answers = [replicas.complete(n % 2, key, max_tokens=8, ignore_eos=True) for n in range(6)]
    assert statuses(answers) == [200] * 3 + [429] * 3, [a.text[:200] for a in answers]
    assert answers[-1].json()["error"]["type"] == "tokens"


def test_a_keys_concurrency_cap_holds_over_both_replicas(replicas: Replicas) -> None:
    key = make_key(replicas.urls[0], ADMIN, "one-at-a-time", max_concurrent_requests=1)
    streamed: list[int] = []
    started = threading.Event()

    def stream_on_the_first() -> None:
        body = {"model": "tiny", "prompt": "Hi", "max_tokens": 600, "ignore_eos": True,
                "stream": True}  # fmt: skip
        headers = {"Authorization": f"Bearer {key}"}
        url = f"{replicas.urls[0]}/v1/completions"
        with httpx.stream("POST", url, json=body, headers=headers, timeout=120) as stream:
            streamed.append(stream.status_code)
            for _ in stream.iter_bytes():
                started.set()

    running = threading.Thread(target=stream_on_the_first)
    running.start()
    try:
        assert started.wait(60), "the stream never began"
        refused = replicas.complete(1, key)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "concurrency_limit_exceeded"
    finally:
        running.join(timeout=120)
    assert streamed == [200]
    # The slot came back on both.
    assert statuses([replicas.complete(1, key), replicas.complete(0, key)]) == [200, 200]


def test_failed_sign_ins_count_on_both_replicas(replicas: Replicas) -> None:
    def guess(replica: int) -> int:
        transport = httpx.HTTPTransport(local_address="127.0.0.5")
        with httpx.Client(transport=transport, timeout=10) as guesser:
            return guesser.post(
                f"{replicas.urls[replica]}/admin/login", data={"token": "a-guess-a-guess-a-guess"}
            ).status_code

    assert [guess(n % 2) for n in range(5)] == [401] * 5
    assert [guess(0), guess(1)] == [429, 429]
