"""Grammars compile off the engine's step loop (issue 48): while a new schema compiles, the
other requests keep stepping; a compile past the site's time limit, a schema the grammar engine
refuses, and a grammar that gives up midway each fail their own request with an error (never a
clean `stop`), through the engine service as RequestRejected. A tiny random Llama with GPT-2's
tokenizer, on the CPU."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fedllm_contract.grammar import ConstraintSpec, refusal
from site_engine.answer_stream import StreamEvent
from site_engine.engine.core.api import EngineRequest, RequestOutput, RequestRejected
from site_engine.engine.core.types import FinishReason, SamplingParams
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.engine_service import EngineService
from site_engine.model_loading import LoadedModel, load_model

PROMPT = (1, 2, 3, 4, 5, 6, 7, 8)


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir: Path) -> Iterator[LoadedModel]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_model(tiny_llama_dir, device="cpu")
    torch.set_num_threads(previous)


def slow_schema() -> str:
    """A schema that takes a good part of a second to compile (0.3-0.7 s on this machine's
    cores; a fresh nonce each time, so no cache has it): 1000 objects of one long-named
    property each, ~230 KiB, just inside the gateway's bounds."""
    key = "k" * 60 + uuid.uuid4().hex[:8]
    return json.dumps(
        {
            "anyOf": [
                {"type": "object", "properties": {f"{key}{i}": {"type": "integer"}},
                 "required": [f"{key}{i}"], "additionalProperties": False}
                for i in range(1000)
            ]
        }
    )  # fmt: skip


def free(request_id: str, max_tokens: int) -> EngineRequest:
    sampling = SamplingParams(max_tokens, temperature=0.0, ignore_eos=True)
    return EngineRequest(request_id, PROMPT, sampling)


def constrained(request_id: str, spec: ConstraintSpec, max_tokens: int = 24) -> EngineRequest:
    sampling = SamplingParams(max_tokens, temperature=0.0, constraint=spec)
    return EngineRequest(request_id, PROMPT, sampling)


def run(engine: PagedEngine) -> list[RequestOutput]:
    outputs: list[RequestOutput] = []
    while engine.has_unfinished():
        outputs += engine.step()
    return outputs


def test_other_requests_step_while_a_new_schema_compiles(loaded: LoadedModel) -> None:
    """The issue's stall: a new schema was compiled inside add_request, on the engine's thread,
    and no request got a token until it was done. Now the engine steps the free request to its
    end while the schema compiles (measured: its four steps take 5-10% of the compile), and
    the constrained request starts once its grammar is ready."""
    engine = PagedEngine(loaded, EngineConfig(max_num_seqs=4))
    spec = ConstraintSpec("json_schema", schema=slow_schema())
    engine.add_request(free("free", 4))
    engine.add_request(constrained("json", spec))
    order: list[tuple[str, FinishReason | None]] = []
    for output in run(engine):
        order.append((output.request_id, output.finish_reason))
    first_json = next(i for i, (rid, _) in enumerate(order) if rid == "json")
    assert ("free", FinishReason.LENGTH) in order[:first_json], order
    assert order[-1][0] == "json"
    assert order[-1][1] in (FinishReason.STOP, FinishReason.LENGTH)
    assert engine.grammars().compiled == 1


def test_a_compile_past_the_time_limit_fails_its_request_alone(loaded: LoadedModel) -> None:
    config = EngineConfig(max_num_seqs=4, grammar_compile_timeout_s=0.01)
    engine = PagedEngine(loaded, config)
    engine.add_request(constrained("slow", ConstraintSpec("json_schema", schema=slow_schema())))
    engine.add_request(free("free", 6))
    outputs = {o.request_id: o for o in run(engine) if o.finish_reason is not None}
    assert outputs["free"].finish_reason is FinishReason.LENGTH
    failed = outputs["slow"]
    assert (failed.finish_reason, failed.new_token_ids) == (FinishReason.ERROR, ())
    assert "longer than this site's limit of 0.01 s" in failed.error
    assert engine.grammars().compiled == 0  # what ran past the limit is not kept


def test_a_schema_the_engine_refuses_fails_its_request_by_name(loaded: LoadedModel) -> None:
    """Compiled off the step loop, a schema llguidance cannot enforce ends its request with
    ERROR naming the feature; once a grammar is cached, add_request answers at once (here, a
    continuation whose answer so far breaks it)."""
    engine = PagedEngine(loaded, EngineConfig(max_num_seqs=4))
    unique = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    engine.add_request(constrained("bad", ConstraintSpec("json_schema", schema=json.dumps(unique))))
    (output,) = run(engine)
    assert output.finish_reason is FinishReason.ERROR
    assert "uniqueItems" in output.error
    spec = ConstraintSpec("json_object")
    engine.grammars().guide(spec)  # compiled and cached
    sampling = SamplingParams(8, temperature=0.0, constraint=spec, generated_before=2)
    with pytest.raises(RequestRejected, match="does not follow its constraint"):
        engine.add_request(EngineRequest("cont", PROMPT, sampling))  # "7 8" is no JSON
    assert not engine.has_unfinished()


# Every branch opens with {"a": {"k...; past that prefix llguidance's parser holds all 2500
# inner branches in one row of its chart, over its limit of 2000, and stops following the answer.
NESTED = {
    "anyOf": [
        {"type": "object", "required": ["a"], "properties": {"a": {"anyOf": [
            {"type": "object", "properties": {f"k{i}_{j}": {"type": "integer"}},
             "required": [f"k{i}_{j}"]}
            for j in range(50)
        ]}}}
        for i in range(50)
    ]
}  # fmt: skip


def test_a_grammar_that_gives_up_midway_ends_in_an_error_not_a_stop(loaded: LoadedModel) -> None:
    """The issue's loose answer: the grammar engine gave up after `{"`, the scheduler logged it
    and finished the answer as a clean `stop`. Now the request ends with ERROR and the reason,
    and the refused token is not part of the answer (GPT-2's `{"`, the first: none is)."""
    spec = ConstraintSpec("json_schema", schema=json.dumps(NESTED))
    assert refusal(spec) == ""  # nothing the gateway can see: it fails only midway
    for overlap in (False, True):
        engine = PagedEngine(loaded, EngineConfig(max_num_seqs=4, async_scheduling=overlap))
        engine.add_request(constrained("nested", spec, max_tokens=40))
        outputs = run(engine)
        last = outputs[-1]
        assert last.finish_reason is FinishReason.ERROR, outputs
        assert "gave up" in last.error
        assert "2000" in last.error
        answer = [t for o in outputs for t in o.new_token_ids]
        text = loaded.tokenizer.decode(answer)
        assert '{"a": {"'.startswith(text), text


def serve(loaded: LoadedModel, *requests: EngineRequest) -> list[list[StreamEvent] | Exception]:
    """Each request's events through an engine service, or the exception generate() raised."""
    service = EngineService(PagedEngine(loaded, EngineConfig(max_num_seqs=4)), loaded.tokenizer)
    service.start()

    async def one(request: EngineRequest) -> list[StreamEvent] | Exception:
        events: list[StreamEvent] = []
        try:
            async for event in service.generate(request):
                events.append(event)
        except RequestRejected as exc:
            return exc
        return events

    async def every() -> list[list[StreamEvent] | Exception]:
        return list(await asyncio.gather(*(one(r) for r in requests)))

    try:
        return asyncio.run(every())
    finally:
        service.stop()


def test_the_service_raises_request_rejected_for_a_failed_constraint(loaded: LoadedModel) -> None:
    """What the site's faces turn into INVALID_ARGUMENT (gRPC) and a 400 (HTTP): never a
    finished answer, and the free request beside it is served whole."""
    nested = ConstraintSpec("json_schema", schema=json.dumps(NESTED))
    unique = json.dumps({"type": "array", "items": {"type": "integer"}, "uniqueItems": True})
    midway, refused, served = serve(
        loaded,
        constrained("nested", nested),
        constrained("unique", ConstraintSpec("json_schema", schema=unique)),
        free("free", 5),
    )
    assert isinstance(midway, RequestRejected)
    assert "gave up" in str(midway)
    assert isinstance(refused, RequestRejected)
    assert "uniqueItems" in str(refused)
    assert isinstance(served, list)
    assert served[-1].finish_reason is FinishReason.LENGTH


def test_the_http_face_answers_a_failed_constraint_with_a_400(loaded: LoadedModel) -> None:
    """The site's OpenAI-compatible face: a whole answer is a 400 invalid_request_error, a
    stream ends in an error event (both came after the request was queued)."""
    from litestar.testing import TestClient

    from site_engine.openai_http import HttpFace

    service = EngineService(PagedEngine(loaded, EngineConfig(max_num_seqs=4)), loaded.tokenizer)
    service.start()
    unique = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    fmt = {"type": "json_schema", "json_schema": {"name": "u", "schema": unique}}
    body = {"model": "tiny", "prompt": "a list", "max_tokens": 8, "response_format": fmt}
    try:
        with TestClient(HttpFace(service, "tiny", len(loaded.tokenizer)).app()) as client:
            whole = client.post("/v1/completions", json=body)
            streamed = client.post("/v1/completions", json={**body, "stream": True})
    finally:
        service.stop()
    assert whole.status_code == 400, whole.text
    assert whole.json()["error"]["type"] == "invalid_request_error"
    assert "uniqueItems" in whole.json()["error"]["message"]
    events = [line for line in streamed.text.splitlines() if line.startswith("data: {")]
    error = json.loads(events[-1].removeprefix("data: "))["error"]
    assert error["type"] == "invalid_request_error"
    assert "uniqueItems" in error["message"]
