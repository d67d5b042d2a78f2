"""The official `openai` Python client against a running gateway (a real `python -m gateway`
uvicorn server on loopback, real site processes): chat and completions, streaming and not."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.e2e.conftest import Federation

pytestmark = pytest.mark.slow

MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You are a poet."},
    {"role": "user", "content": [{"type": "text", "text": "Write about the moon."}]},
]


@pytest.fixture(scope="module")
def federation(start_federation) -> Federation:
    return start_federation(live=["aws-use1", "gcp-euw4"])


@pytest.fixture(scope="module")
def client(federation: Federation) -> Iterator[openai.OpenAI]:
    # The gateway has no API keys yet; the client insists on one.
    with openai.OpenAI(
        base_url=f"{federation.base_url}/v1", api_key="unused", max_retries=0, timeout=60
    ) as client:
        yield client


def test_models(client: openai.OpenAI) -> None:
    assert [model.id for model in client.models.list()] == ["tiny"]


def test_chat_completion(client: openai.OpenAI, federation: Federation) -> None:
    response = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_completion_tokens=8,
        temperature=0.7,
        top_p=0.95,
        seed=7,
        user="moon-user",
    )
    assert response.object == "chat.completion"
    (choice,) = response.choices
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    assert response.usage is not None
    assert response.usage.completion_tokens == 8
    assert response.usage.total_tokens == response.usage.prompt_tokens + 8
    again = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=8, temperature=0.7, top_p=0.95, seed=7
    )
    assert again.choices[0].message.content == choice.message.content  # same seed, same answer
    (row,) = federation.rows(f"r.id = '{response.id}'")
    assert (row["api"], row["user"], row["max_tokens"]) == ("chat.completions", "moon-user", 8)


def test_streaming_chat_with_usage_in_the_last_chunk(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.completion_tokens == 6
    assert all(chunk.usage is None for chunk in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == "length"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    whole = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=6, temperature=0
    )
    assert streamed == whole.choices[0].message.content
    assert whole.usage == last.usage


def test_chat_stop_sequence(client: openai.OpenAI) -> None:
    def answer(stop: list[str] | None) -> tuple[str, str]:
        response = client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=24,
            temperature=0,
            stop=stop,
            extra_body={"ignore_eos": True},
        )
        choice = response.choices[0]
        return choice.message.content or "", choice.finish_reason

    free, _ = answer(None)
    assert len(free) >= 8
    stop = free[4:7]
    assert answer([stop, "never-seen-string"]) == (free[: free.index(stop)], "stop")


def test_completions_streaming_and_not(client: openai.OpenAI) -> None:
    whole = client.completions.create(
        model="tiny", prompt="The moon is", max_tokens=5, temperature=0, stop=["zzzz"]
    )
    assert whole.object == "text_completion"
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None
    assert whole.usage.completion_tokens == 5
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt="The moon is",
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].choices == []
    assert chunks[-1].usage == whole.usage
    assert "".join(c.choices[0].text for c in chunks[:-1]) == whole.choices[0].text


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 99}, "n"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "tools[0].function.parameters",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens"),
    ],
)
def test_unsupported_parameter_is_a_bad_request_naming_it(
    client: openai.OpenAI, federation: Federation, extra: dict[str, object], param: str
) -> None:
    before = len(federation.rows())
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=MESSAGES, **extra)  # type: ignore[call-overload]
    assert caught.value.status_code == 400
    assert caught.value.param == param
    assert caught.value.type == "invalid_request_error"
    assert param in caught.value.message
    assert len(federation.rows()) == before


def test_unsupported_completions_parameter_is_a_bad_request(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt="hi", n=99)
    assert caught.value.param == "n"


def test_unknown_model_is_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-17", messages=MESSAGES)
    assert caught.value.param == "model"


def test_embeddings_without_an_embedding_model_say_none_is_configured(
    client: openai.OpenAI, federation: Federation
) -> None:
    """The endpoint exists; this federation (a chat model only) has no model to serve it."""
    before = len(federation.rows())
    with pytest.raises(openai.NotFoundError) as caught:
        client.embeddings.create(model="tiny", input="hello")
    assert (caught.value.code, caught.value.param) == ("model_not_found", "model")
    assert "/v1/embeddings is served here" in caught.value.message
    assert "no embedding model is configured on this gateway" in caught.value.message
    assert len(federation.rows()) == before


@pytest.mark.parametrize(("method", "path"), [("POST", "/v1/audio/speech"), ("GET", "/v1/foo")])
def test_an_unknown_v1_path_is_an_openai_error_naming_it(
    federation: Federation, method: str, path: str
) -> None:
    answer = httpx.request(method, f"{federation.base_url}{path}", json={"x": 1}, timeout=30)
    assert answer.status_code == 404
    assert answer.headers["content-type"].startswith("application/json")
    error = answer.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "unknown_url")
    assert error["message"].startswith(f"Invalid URL ({method} {path}): this gateway does not "
                                       f"implement {path} of the OpenAI API")  # fmt: skip
    served_paths = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models",
                    "/v1/responses")  # fmt: skip
    for served in served_paths:
        assert served in error["message"]
