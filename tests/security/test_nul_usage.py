"""Issue 32, finding 1 (usage escapes billing): a prompt, a message or `user` holding U+0000 was
served, but PostgreSQL refused the request's row ("the request log refused <id>; dropped"):
usage showed no completion tokens, rows stayed `dispatched`, and with `user: "\\u0000"` no row
existed at all, so any key holder could be served without being billed. NUL in a path, a query
or a batch item's custom_id answered 500.

Real gateway, real PostgreSQL: every answer served is in the key's usage, to the token, and
the hostile ids get 400/404.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator

import httpx
import pytest

from gateway.db.migrate import downgrade
from tests.e2e.conftest import Federation
from tests.support.api_keys import make_key

pytestmark = [pytest.mark.slow, pytest.mark.postgres]
ADMIN = "admin-token-for-the-nul-tests"
NUL = "\u0000"


@pytest.fixture(scope="module")
def federation(start_federation, postgres_url: str) -> Iterator[Federation]:
    env = {"GATEWAY_ADMIN_TOKEN": ADMIN, "GATEWAY_REQUIRE_API_KEYS": "true"}
    started: Federation = start_federation(live=["aws-use1"], database_url=postgres_url, env=env)
    try:
        yield started
    finally:
        started.gateway.stop()
        downgrade(postgres_url)  # the session's database is shared: leave it empty


def _usage(federation: Federation, name: str) -> dict[str, int]:
    ((key_id,),) = federation.query(f"SELECT id FROM api_keys WHERE name = '{name}'")
    usage: dict[str, int] = httpx.get(
        f"{federation.base_url}/admin/api/keys/{key_id}/usage",
        headers={"Authorization": f"Bearer {ADMIN}"},
        timeout=10,
    ).json()
    return usage


def test_nul_in_a_prompt_a_message_or_user_is_billed(federation: Federation) -> None:
    key = make_key(federation.base_url, ADMIN, "nul-billed")
    headers = {"Authorization": f"Bearer {key}"}
    bodies = [
        ("/v1/completions", {"prompt": f"Hi{NUL} there", "max_tokens": 5}),
        ("/v1/completions", {"prompt": "Hello", "max_tokens": 6, "user": NUL}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": f"a{NUL}b"}], "max_tokens": 7},
        ),
    ]
    told = []
    for path, body in bodies:
        answer = httpx.post(
            f"{federation.base_url}{path}",
            json={"model": "tiny", "ignore_eos": True, **body},
            headers=headers,
            timeout=60,
        )
        assert answer.status_code == 200, answer.text
        told.append(answer.json()["usage"])
    usage = _usage(federation, "nul-billed")
    assert usage["requests"] == 3
    assert usage["completion_tokens"] == sum(u["completion_tokens"] for u in told) == 5 + 6 + 7
    assert usage["prompt_tokens"] == sum(u["prompt_tokens"] for u in told)
    ((key_id,),) = federation.query("SELECT id FROM api_keys WHERE name = 'nul-billed'")
    rows = federation.rows(f"r.api_key_id = {key_id}")
    assert [row["status"] for row in rows] == ["completed"] * 3
    assert {row["user"] for row in rows} == {None, "\ufffd"}  # kept, in a form PostgreSQL takes
    samples = federation.query(
        "SELECT s.prompt FROM length_samples s JOIN requests r ON r.id = s.request_id "
        f"WHERE r.api_key_id = {key_id}"
    )
    assert len(samples) == 3  # the retraining samples too


@pytest.mark.parametrize(
    "path",
    [
        "/v1/files/%00",
        "/v1/files/%00/content",
        "/v1/files?after=%00",
        "/v1/batches/%00",
        "/v1/batches/%00/results",
        "/v1/batches?after=%00",
        "/admin/api/sites/%00",
    ],
)
def test_nul_in_a_path_or_query_is_a_client_error(federation: Federation, path: str) -> None:
    key = make_key(federation.base_url, ADMIN, f"nul-path-{abs(hash(path))}")
    token = ADMIN if path.startswith("/admin") else key
    answer = httpx.get(
        f"{federation.base_url}{path}", headers={"Authorization": f"Bearer {token}"}, timeout=30
    )
    assert answer.status_code in (400, 404), answer.text
    assert isinstance(answer.json()["error"]["message"], str)


def test_nul_in_a_custom_id_is_refused_naming_it(federation: Federation) -> None:
    key = make_key(federation.base_url, ADMIN, "nul-custom-id")
    headers = {"Authorization": f"Bearer {key}"}
    item = {"custom_id": f"a{NUL}b", "prompt": "x", "max_tokens": 1}
    inline = httpx.post(
        f"{federation.base_url}/v1/batches",
        json={"model": "tiny", "requests": [item]},
        headers=headers,
        timeout=30,
    )
    assert inline.status_code == 400, inline.text
    assert inline.json()["error"]["param"] == "requests[0]"
    assert "custom_id" in inline.json()["error"]["message"]

    line = {"custom_id": f"a{NUL}b", "method": "POST", "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": "x", "max_tokens": 1}}  # fmt: skip
    upload = httpx.post(
        f"{federation.base_url}/v1/files",
        files={"file": ("in.jsonl", io.BytesIO(json.dumps(line).encode()))},
        data={"purpose": "batch"},
        headers=headers,
        timeout=30,
    )
    assert upload.status_code == 400, upload.text
    assert "line 1" in upload.json()["error"]["message"]
    assert "custom_id" in upload.json()["error"]["message"]
