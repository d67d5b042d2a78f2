"""A 32k-token prompt through the gateway to a site and back, with the official `openai` client.

The site serves a tiny Llama with Llama-3.1's rope scaling and 131,072 positions (its
config.json written as the hub ships it). On the way the prompt meets every bound that could
refuse or stall it: the gateway's body limit (1 MiB) and its character bound (32 characters per
token of context), tokenizing on the gateway's pool rather than its event loop, the gRPC message
to the site (4 MiB accepted there: 32k token ids are ~100 KB), and the site's chunked prefill
over a cache that holds it. The answer must come back whole, with the prompt's token count.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from devtools.launch import spawn_site, start_gateway, stop_all, wait_until_serving
from fedllm_contract.tokenizer import load_tokenizer
from site_engine.make_model import make_long_context_dir
from tests.e2e.conftest import write_federation

pytestmark = pytest.mark.slow
PROMPT_TOKENS = 32_000
WORDS = ("river", "stone", "light", "market", "winter", "engine", "garden", "signal", "paper")


@pytest.fixture(scope="module")
def gateway_url(
    tmp_path_factory: pytest.TempPathFactory, gpt2_tokenizer_dir: Path
) -> Iterator[str]:
    work = tmp_path_factory.mktemp("long-context")
    model = make_long_context_dir(work / "long-llama", gpt2_tokenizer_dir)
    site = spawn_site(model_dir=model, site_name="aws-use1", model_name="tiny", log_dir=work)
    started = [site]
    try:
        wait_until_serving(site)
        federation = write_federation(
            work / "federation.json", model, {"aws-use1": f"127.0.0.1:{site.port}"}
        )
        gateway = start_gateway(
            federation_file=federation,
            database_url=f"sqlite+aiosqlite:///{work / 'gateway.db'}",
            log_dir=work,
        )
        started.append(gateway)
        yield f"http://127.0.0.1:{gateway.port}"
    finally:
        stop_all(list(reversed(started)))


def _prompt(tokenizer_dir: Path) -> tuple[str, int]:
    """Words until the GPT-2 tokenizer counts PROMPT_TOKENS tokens (one per word here)."""
    rng = random.Random(3)
    text = " ".join(rng.choice(WORDS) for _ in range(PROMPT_TOKENS))
    return text, len(load_tokenizer(tokenizer_dir).encode(text))


def test_a_32k_token_prompt_is_served(gateway_url: str, gpt2_tokenizer_dir: Path) -> None:
    text, tokens = _prompt(gpt2_tokenizer_dir)
    assert tokens >= PROMPT_TOKENS
    with openai.OpenAI(
        base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0, timeout=300
    ) as client:
        response = client.completions.create(
            model="tiny", prompt=text, max_tokens=4, temperature=0.0
        )
        assert response.usage is not None
        assert response.usage.prompt_tokens == tokens
        assert response.usage.completion_tokens == 4
        assert response.choices[0].finish_reason == "length"
        # Streaming takes the same path and ends the same way.
        chunks = list(
            client.completions.create(
                model="tiny", prompt=text, max_tokens=4, temperature=0.0, stream=True
            )
        )
        assert chunks[-1].choices[0].finish_reason == "length"
        assert "".join(c.choices[0].text for c in chunks) == response.choices[0].text
