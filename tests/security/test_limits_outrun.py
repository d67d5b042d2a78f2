"""Finding 4: token limits could be outrun by long requests. Admission charged prompt + planned
answer; settlement corrected the charge only while it was still in its 60 s window, so a request
that ran past the window never paid its real size; and `ignore_eos` forced answers the predictor
could not foresee.

Through the public API (a real gateway serving a length predictor, a real site): a request that
could take more than its key's whole per-minute budget is refused, and `ignore_eos` requests are
charged their full `max_tokens` when admitted, so two at once cannot both slip under the limit.
The window itself is driven with a clock (a minute-long request is not waited for): a charge
settled after it left the window pays its overrun, and the escape measured in the issue (~44x
the limit over 3 minutes) no longer grows with time.

Issue 32, finding 7: a 700 tokens/min key still ran 1,732 tokens in 25 s by under-prediction
(four concurrent prompts predicted at 142 tokens generated 400 each). A request is now admitted
only if its prompt + max_tokens fits beside what the key's unfinished requests may still take,
within GATEWAY_TOKEN_LIMIT_OVERSHOOT (1.2) times the limit: through the same gateway, with
answers that run to max_tokens while the predictor expects far fewer.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

import httpx
import pytest

from bench.security.limiter_outrun import LIMIT, served_tokens
from gateway.tenancy.limiter import Charge, Limits, SlidingWindowLimiter
from tests.e2e.conftest import Federation
from tests.support.api_keys import make_key
from tests.support.predictor_artifact import small_artifact

ADMIN = "admin-token-for-the-outrun-tests"
TPM = 300
# Issue 32, finding 7: the predictor expects ~135 answer tokens for these prompts; the site
# generates max_tokens.
PROMPTS = ("Hi", "What is 2+2?", "x")
PROBE_TPM, MAX_TOKENS, CLIENTS, SENDING_S = 700, 400, 8, 15.0


@pytest.fixture(scope="module")
def federation(start_federation, tmp_path_factory: pytest.TempPathFactory) -> Federation:
    artifact = small_artifact(tmp_path_factory.mktemp("predictor") / "base")
    return start_federation(
        live=["aws-use1"],
        env={
            "GATEWAY_ADMIN_TOKEN": ADMIN,
            "GATEWAY_REQUIRE_API_KEYS": "true",
            "GATEWAY_PREDICTOR_DIR": str(artifact),
        },
    )


def new_key(federation: Federation) -> str:
    return make_key(federation.base_url, ADMIN, "outrun", tokens_per_minute=TPM)


def complete(federation: Federation, key: str, max_tokens: int) -> httpx.Response:
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": max_tokens, "ignore_eos": True}
    return httpx.post(
        f"{federation.base_url}/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
    )


@pytest.mark.slow
def test_one_request_may_not_take_more_than_its_keys_minute(federation: Federation) -> None:
    key = new_key(federation)
    response = complete(federation, key, TPM + 50)
    assert response.status_code == 429, response.text
    assert response.json()["error"]["code"] == "rate_limit_exceeded"
    assert "retry-after" not in response.headers  # it never fits: no point retrying


@pytest.mark.slow
def test_ignore_eos_requests_are_charged_their_whole_answer(federation: Federation) -> None:
    key = new_key(federation)
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda _: complete(federation, key, 200), range(2)))
    statuses = sorted(a.status_code for a in answers)
    assert statuses == [200, 429], [a.text[:200] for a in answers]
    served = next(a for a in answers if a.status_code == 200).json()["usage"]
    assert served["completion_tokens"] == 200


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_request_that_outlasts_the_window_pays_its_overrun() -> None:
    clock = Clock()
    limiter = SlidingWindowLimiter(clock)
    limits = Limits(None, 10_000)
    first = limiter.admit(1, limits, 1, 30)
    assert isinstance(first, Charge)
    clock.now += 90  # the request runs past the window...
    limiter.settle(first, 2_010)  # ...and ends having taken 2,010 tokens
    assert limiter.used(1) == (0, 1_980)  # its overrun is charged now


def test_the_long_request_escape_no_longer_grows_with_time() -> None:
    """The issue's measurement (bench/security/limiter_outrun.py): 30-token charges settling at
    2,010 tokens after the window, on a 10k tokens/min key. Before the fix the escape grew with
    time (the test fails on the earlier limiter); with overruns charged it shrinks. What is left
    is the first minute's burst of under-predicted requests, which a key's
    max_concurrent_requests bounds (docs/security.md)."""
    three, ten = served_tokens(180) / (LIMIT * 3), served_tokens(600) / (LIMIT * 10)
    assert ten < three < 30


def most_in_any_window(rows: list[tuple[datetime, int]], window_s: float = 60.0) -> int:
    """The most tokens of requests admitted within any `window_s` (each window starting at an
    admission)."""
    rows = sorted(rows)
    return max(
        sum(tokens for at, tokens in rows[i:] if (at - start).total_seconds() < window_s)
        for i, (start, _) in enumerate(rows)
    )


@pytest.mark.slow
def test_under_predicted_requests_stay_within_the_overshoot(federation: Federation) -> None:
    """Issue 32, finding 7: eight clients keep asking on one 700 tokens/min key; the tokens of
    the requests admitted within any 60 s stay within GATEWAY_TOKEN_LIMIT_OVERSHOOT (1.2) times
    the limit (before: four to five admitted at once took 2,010 tokens, 2.87x)."""
    key = make_key(federation.base_url, ADMIN, "overshoot", tokens_per_minute=PROBE_TPM)
    stop = threading.Event()

    def client(n: int) -> list[int]:
        statuses = []
        with httpx.Client(headers={"Authorization": f"Bearer {key}"}, timeout=120) as http:
            while not stop.is_set():
                answer = http.post(
                    f"{federation.base_url}/v1/completions",
                    json={"model": "tiny", "prompt": PROMPTS[n % 3], "max_tokens": MAX_TOKENS},
                )
                statuses.append(answer.status_code)
                if answer.status_code == 429:
                    stop.wait(0.5)
        return statuses

    with ThreadPoolExecutor(CLIENTS) as pool:
        running = [pool.submit(client, n) for n in range(CLIENTS)]
        time.sleep(SENDING_S)  # how long the clients keep asking, not a synchronisation
        stop.set()
        statuses = [status for future in running for status in future.result()]
    assert 200 in statuses
    assert 429 in statuses
    rows = federation.query(
        "SELECT r.created_at, r.prompt_tokens, r.completion_tokens, r.predicted_tokens "
        "FROM requests r JOIN api_keys k ON k.id = r.api_key_id WHERE k.name = 'overshoot'"
    )
    taken = [
        (str(at), int(str(prompt)), int(str(done)), predicted)
        for at, prompt, done, predicted in rows
    ]
    # Under-predicted, as the probe was (a random model may end one early at its EOS).
    assert any(
        predicted is not None and int(str(predicted)) < done for *_, done, predicted in taken
    )
    admitted = [(datetime.fromisoformat(at), prompt + done) for at, prompt, done, _ in taken]
    most = most_in_any_window(admitted)
    print(
        f"{len(rows)} requests admitted; most in any 60 s: {most} tokens, {most / PROBE_TPM:.2f}x"
    )
    assert most <= 1.2 * PROBE_TPM, (
        f"{most} tokens admitted within 60 s: {most / PROBE_TPM:.2f}x the limit"
    )
