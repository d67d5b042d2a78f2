"""Finding 3: large prompts stalled the event loop. Tokenizing ran on the loop before the context
check, so a few requests with a 1 MB prompt held every stream and `/healthz` for seconds (long
enough to fail the load balancer's health check), only to be refused as too long.

Through the public API: while prompts far over the model's context (characters per token of
context bounded by GATEWAY_MAX_PROMPT_CHARS_PER_TOKEN) arrive, `/healthz` keeps answering at
once; each such prompt is refused with `context_length_exceeded` without being tokenized, on
completions and chat alike. With the bound loosened so that the same prompts are tokenized,
`/healthz` still answers at once: tokenizing runs on a thread pool, off the event loop.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.conftest import Federation
from tests.security.healthz_probe import probing_healthz, quiet_worst_s, stall_limit_s

pytestmark = pytest.mark.slow
HUGE = "word " * 200_000  # 1,000,000 characters: under the 1 MiB body limit


@pytest.fixture(scope="module")
def federation(start_federation) -> Federation:
    return start_federation(live=["aws-use1"])


def send_huge_prompts(federation: Federation) -> tuple[list[httpx.Response], float, float]:
    """Eight huge prompts (completions and chat) while /healthz is probed: the answers, the
    slowest /healthz (bounded by the gateway's CPU time meanwhile), and the most it may take on
    this machine now (healthz_probe)."""
    base, pid = federation.base_url, federation.gateway.popen.pid
    limit_s = stall_limit_s(quiet_worst_s(base, server_pid=pid))
    bodies = [
        ("/v1/completions", {"model": "tiny", "prompt": HUGE, "max_tokens": 1}),
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": HUGE}], "max_tokens": 1},
        ),
    ]
    with probing_healthz(base, server_pid=pid) as probe, ThreadPoolExecutor(4) as pool:
        answers = list(
            pool.map(
                lambda i: httpx.post(base + bodies[i % 2][0], json=bodies[i % 2][1], timeout=120),
                range(8),
            )
        )
    return answers, probe.worst_s, limit_s


def test_huge_prompts_are_refused_without_stalling_the_gateway(federation: Federation) -> None:
    answers, worst_s, limit_s = send_huge_prompts(federation)
    assert worst_s < limit_s, f"/healthz took {worst_s:.2f} s while the prompts arrived"
    for answer in answers:
        assert answer.status_code == 400, answer.text[:300]
        error = answer.json()["error"]
        assert error["code"] == "context_length_exceeded"
        assert "characters" in error["message"]  # refused on length, not after tokenizing


def test_prompts_that_are_tokenized_do_not_stall_the_gateway(start_federation) -> None:
    loose: Federation = start_federation(
        live=["gcp-euw4"], env={"GATEWAY_MAX_PROMPT_CHARS_PER_TOKEN": "10000"}
    )
    answers, worst_s, limit_s = send_huge_prompts(loose)
    for answer in answers:
        assert answer.status_code == 400, answer.text[:300]
        assert "tokens" in answer.json()["error"]["message"]  # tokenized, then refused
    assert worst_s < limit_s, (
        f"/healthz took {worst_s:.2f} s (limit {limit_s:.2f} s) while the prompts were tokenized"
    )
