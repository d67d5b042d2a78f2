"""Issue 32, finding 8 (first half): JSON nested deeper than the decoder recurses (a chat content
part, a JSONL upload line) answered 500 with a RecursionError. Every body the gateway decodes
is now refused as invalid JSON (400 in the OpenAI shape), and the gateway serves on."""

from __future__ import annotations

import io

import httpx
import pytest

from tests.e2e.conftest import Federation

pytestmark = pytest.mark.slow
ADMIN = "admin-token-for-the-hostile-json-tests"
DEPTH = 50_000
DEEP = "[" * DEPTH + "]" * DEPTH


@pytest.fixture(scope="module")
def federation(start_federation) -> Federation:
    return start_federation(live=["aws-use1"], env={"GATEWAY_ADMIN_TOKEN": ADMIN})


def _post(federation: Federation, path: str, body: str) -> httpx.Response:
    headers = {"Content-Type": "application/json"}
    if path.startswith("/admin"):
        headers["Authorization"] = f"Bearer {ADMIN}"
    return httpx.post(f"{federation.base_url}{path}", content=body, headers=headers, timeout=30)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/chat/completions",
            '{"model": "tiny", "messages": [{"role": "user", "content": '
            f'[{{"type": "text", "text": "hi", "x": {DEEP}}}]}}]}}',
        ),
        ("/v1/completions", f'{{"model": "tiny", "prompt": {DEEP}}}'),
        ("/v1/batches", f'{{"model": "tiny", "requests": [{{"custom_id": "a", "x": {DEEP}}}]}}'),
        ("/admin/api/keys", f'{{"name": "k", "x": {DEEP}}}'),
    ],
)
def test_deeply_nested_bodies_are_refused(federation: Federation, path: str, body: str) -> None:
    answer = _post(federation, path, body)
    assert answer.status_code == 400, answer.text[:300]
    assert isinstance(answer.json()["error"]["message"], str)


def test_a_deeply_nested_upload_line_is_refused_naming_it(federation: Federation) -> None:
    line = (
        '{"custom_id": "a", "method": "POST", "url": "/v1/completions", '
        f'"body": {{"model": "tiny", "prompt": {DEEP}}}}}'
    )
    answer = httpx.post(
        f"{federation.base_url}/v1/files",
        files={"file": ("in.jsonl", io.BytesIO(line.encode()))},
        data={"purpose": "batch"},
        timeout=30,
    )
    assert answer.status_code == 400, answer.text[:300]
    assert "line 1" in answer.json()["error"]["message"]
    served = httpx.post(
        f"{federation.base_url}/v1/completions",
        json={"model": "tiny", "prompt": "still here", "max_tokens": 2},
        timeout=30,
    )
    assert served.status_code == 200, served.text
