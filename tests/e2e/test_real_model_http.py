"""A real instruct model through the public API: two sites serving SmolLM2-135M-Instruct from
its GGUF file (`--model file.gguf`), the gateway rendering chats with the template that came
inside that file, and answers that end at the model's own EOS. The README's curl and openai SDK
examples run here as written, their port the gateway's: the README cannot drift from the code."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from devtools.launch import LaunchError, spawn_site
from devtools.launch import wait_until_serving as wait_serving
from tests.e2e.smollm2_federation import MODEL, smollm2_federation
from tests.support.readme import curl_example, sdk_example, with_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def real_federation(
    smollm2_gguf: Path, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    with smollm2_federation(smollm2_gguf, smollm2_dir, tmp_path_factory.mktemp("real")) as fed:
        yield fed.base_url


def test_chat_answers_for_real_and_stops_at_eos(real_federation: str) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 64,
        "temperature": 0,
    }
    response = httpx.post(f"{real_federation}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    answer = response.json()
    choice = answer["choices"][0]
    assert "Paris" in choice["message"]["content"]
    assert choice["finish_reason"] == "stop"
    assert answer["usage"]["completion_tokens"] < 64
    assert "<|im_end|>" not in choice["message"]["content"]


def _port(base_url: str) -> int:
    return int(base_url.rsplit(":", 1)[1])


def test_the_readmes_curl_example_answers_as_written(real_federation: str) -> None:
    command = with_port(curl_example(), _port(real_federation))
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["object"] == "chat.completion", answer
    assert answer["model"] == MODEL
    assert answer["choices"][0]["message"]["content"].strip()
    assert 0 < answer["usage"]["completion_tokens"] <= 64


def test_the_readmes_sdk_example_answers_as_written(real_federation: str) -> None:
    code = with_port(sdk_example(), _port(real_federation))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    text, usage = done.stdout.rsplit("CompletionUsage(", 1)
    assert text.strip()
    assert "completion_tokens=" in usage


def test_models_list_the_gguf_model(real_federation: str) -> None:
    response = httpx.get(f"{real_federation}/v1/models", timeout=10)
    assert [m["id"] for m in response.json()["data"]] == [MODEL]


def test_a_prompt_longer_than_the_context_is_refused(real_federation: str) -> None:
    body = {"model": MODEL, "prompt": "hello " * 9000, "max_tokens": 16}
    response = httpx.post(f"{real_federation}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert "8192" in error["message"]


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"not a model at all", "is not a GGUF file"),
        (None, "could not be read as a model"),  # the real file, truncated
    ],
    ids=["not-gguf", "truncated"],
)
def test_a_broken_gguf_stops_the_site_with_a_clear_error(
    smollm2_gguf: Path, tmp_path: Path, content: bytes | None, says: str
) -> None:
    broken = tmp_path / "broken.Q4_1.gguf"
    with smollm2_gguf.open("rb") as handle:
        broken.write_bytes(content if content is not None else handle.read(1 << 20))
    site = spawn_site(
        model_dir=broken,
        site_name="broken",
        model_name="broken",
        log_dir=tmp_path,
        env={"FEDLLM_MODEL_CACHE": str(tmp_path / "cache")},
    )
    try:
        with pytest.raises(LaunchError, match=says):
            wait_serving(site, timeout_s=120)
    finally:
        site.stop()
    # Nothing half-converted is left for a later start to trust.
    assert not any((tmp_path / "cache").glob("*/config.json"))
