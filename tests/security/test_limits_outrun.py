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
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from bench.security.limiter_outrun import LIMIT, served_tokens
from gateway.tenancy.limiter import Charge, Limits, SlidingWindowLimiter
from tests.e2e.conftest import Federation
from tests.support.api_keys import make_key
from tests.support.predictor_artifact import small_artifact

ADMIN = "admin-token-for-the-outrun-tests"
TPM = 300


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
