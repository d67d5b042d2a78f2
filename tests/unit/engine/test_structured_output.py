"""Constrained decoding on real weights (SmolLM2-135M-Instruct, float32 on the CPU): answers
that follow their JSON schema, grammars compiled once per schema, a schema the engine cannot
enforce refused by name, and unconstrained greedy answers token-identical whether or not
constrained requests share their batch, with synchronous and with async (overlapped) steps."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import jsonschema_rs
import pytest

from fedllm_contract.grammar import ConstraintSpec
from site_engine.engine.core.api import EngineRequest, RequestOutput, RequestRejected
from site_engine.engine.core.types import FinishReason, SamplingParams
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.model_loading import LoadedModel
from tests.support.engine_runs import generate_all
from tests.unit.engine.smollm2 import chat_ids, loaded

pytestmark = pytest.mark.slow
__all__ = ["loaded"]  # the module-scoped fixture, shared with the other SmolLM2 tests

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
FREE_PROMPTS = ("What is the capital of France?", "Give two tips for sleeping well.")
JSON_PROMPT = "Describe a person as JSON with name, age and city."


def engine(loaded: LoadedModel, overlap: bool) -> PagedEngine:
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, async_scheduling=overlap)
    return PagedEngine(loaded, config)


def free(loaded: LoadedModel, i: int) -> EngineRequest:
    sampling = SamplingParams(max_tokens=24, temperature=0.0)
    return EngineRequest(f"free-{i}", chat_ids(loaded, FREE_PROMPTS[i]), sampling)


def constrained(loaded: LoadedModel, name: str, spec: ConstraintSpec) -> EngineRequest:
    sampling = SamplingParams(max_tokens=60, temperature=0.0, constraint=spec)
    return EngineRequest(name, chat_ids(loaded, JSON_PROMPT), sampling)


def text(loaded: LoadedModel, ids: list[int]) -> str:
    return str(loaded.tokenizer.decode(ids, skip_special_tokens=True))


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
def test_constrained_answers_validate_and_free_answers_do_not_change(
    loaded: LoadedModel, overlap: bool
) -> None:
    alone = generate_all(engine(loaded, overlap), [free(loaded, 0), free(loaded, 1)])
    schema = ConstraintSpec("json_schema", schema=json.dumps(PERSON))
    sampled = SamplingParams(max_tokens=60, temperature=0.9, seed=5, constraint=schema)
    mixed_engine = engine(loaded, overlap)
    requests = [
        free(loaded, 0),
        constrained(loaded, "json-greedy", schema),
        free(loaded, 1),
        EngineRequest("json-sampled", chat_ids(loaded, JSON_PROMPT), sampled),
        constrained(loaded, "object", ConstraintSpec("json_object")),
    ]
    mixed = generate_all(mixed_engine, requests)
    assert mixed["free-0"] == alone["free-0"]
    assert mixed["free-1"] == alone["free-1"]
    validator = jsonschema_rs.validator_for(PERSON)
    for name in ("json-greedy", "json-sampled"):
        answer = json.loads(text(loaded, mixed[name]))
        assert validator.is_valid(answer), answer
    assert isinstance(json.loads(text(loaded, mixed["object"])), dict)
    # One compile per distinct constraint, however many requests use it.
    assert mixed_engine.grammars().compiled == 2


def test_a_schema_feature_the_engine_cannot_enforce_is_refused_by_name(
    loaded: LoadedModel,
) -> None:
    """Its grammar compiles off the engine's thread: the request ends with ERROR naming the
    feature, no token generated (the site's faces answer INVALID_ARGUMENT / 400)."""
    unenforceable = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    spec = ConstraintSpec("json_schema", schema=json.dumps(unenforceable))
    paged = engine(loaded, False)
    paged.add_request(constrained(loaded, "bad", spec))
    outputs: list[RequestOutput] = []
    while paged.has_unfinished():
        outputs += paged.step()
    (output,) = outputs
    assert (output.finish_reason, output.new_token_ids) == (FinishReason.ERROR, ())
    assert "uniqueItems" in output.error


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_strict_answer_has_no_whitespace_between_tokens(
    loaded: LoadedModel, temperature: float
) -> None:
    """Issue 49: the grammar allowed up to 24 whitespace characters between tokens and
    SmolLM2 put a newline between almost every token. Now its answer is written exactly as
    json.dumps writes its value: no newline, one space after ':' and ','."""
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 30},
            "country": {"type": "string", "maxLength": 30},
            "population_millions": {"type": "number", "minimum": 0, "maximum": 100},
            "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 30},
                          "maxItems": 3},
        },
        "required": ["name", "country", "population_millions", "landmarks"],
        "additionalProperties": False,
    }  # fmt: skip
    spec = ConstraintSpec("json_schema", schema=json.dumps(schema))
    sampling = SamplingParams(max_tokens=120, temperature=temperature, seed=3, constraint=spec)
    request = EngineRequest("city", chat_ids(loaded, "Describe Paris as a city record."), sampling)
    answer = text(loaded, generate_all(engine(loaded, True), [request])["city"])
    value = json.loads(answer)
    assert "\n" not in answer
    # Outside its strings, every ':' and ',' is followed by one space, and no other whitespace.
    structure = re.sub(r'"(?:[^"\\]|\\.)*"', '""', answer)
    assert re.fullmatch(r"(?:[^\s:,]|: |, )*", structure), answer
    assert jsonschema_rs.validator_for(schema).is_valid(value), value


def test_tool_calls_in_tags_follow_their_schema(loaded: LoadedModel) -> None:
    call = {
        "type": "object",
        "properties": {
            "name": {"const": "get_weather"},
            "arguments": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
    spec = ConstraintSpec(
        "tagged_json",
        schema=json.dumps(call),
        begin="<tool_call>\n",
        end="\n</tool_call>",
        min_items=1,
        max_items=1,
    )
    answer = text(
        loaded, generate_all(engine(loaded, True), [constrained(loaded, "tool", spec)])["tool"]
    )
    assert answer.startswith("<tool_call>\n")
    assert answer.endswith("\n</tool_call>")
    body = json.loads(answer.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
    assert body["name"] == "get_weather"
    assert isinstance(body["arguments"]["city"], str)


def test_a_continued_constrained_answer_goes_on_where_it_stopped(loaded: LoadedModel) -> None:
    """A site that continues an answer begun elsewhere (prompt + the answer so far,
    generated_before) carries its grammar on from there: greedy, the two halves are the
    uninterrupted answer; an answer so far that breaks the grammar is refused."""
    spec = ConstraintSpec("json_schema", schema=json.dumps(PERSON))
    whole = generate_all(engine(loaded, False), [constrained(loaded, "whole", spec)])["whole"]
    prompt = chat_ids(loaded, JSON_PROMPT)
    kept = whole[:7]
    sampling = SamplingParams(
        max_tokens=60 - len(kept), temperature=0.0, constraint=spec, generated_before=len(kept)
    )
    rest = generate_all(
        engine(loaded, False), [EngineRequest("rest", prompt + tuple(kept), sampling)]
    )
    assert kept + rest["rest"] == whole
    broken = prompt + tuple(loaded.tokenizer.encode("nope", add_special_tokens=False))
    bad = EngineRequest("bad", broken, replace(sampling, generated_before=2))
    # Refused at once where the grammar is compiled already, else once it is.
    warm = engine(loaded, False)
    warm.grammars().guide(spec)
    with pytest.raises(RequestRejected, match="does not follow its constraint"):
        warm.add_request(bad)
    cold = engine(loaded, False)
    cold.add_request(bad)
    outputs: list[RequestOutput] = []
    while cold.has_unfinished():
        outputs += cold.step()
    assert [o.finish_reason for o in outputs] == [FinishReason.ERROR]
    assert "does not follow its constraint" in outputs[0].error


def test_masks_filled_on_the_filler_thread_equal_masks_filled_inline(loaded: LoadedModel) -> None:
    """The engine's async steps fill masks on MaskFiller's thread: the same words as filling
    them inline, for guides at different points of their answers and a finished one, fill after
    fill; a second fill may not start while one runs, and a closed filler takes no more."""
    import numpy as np

    from site_engine.engine.structured_output import MaskFiller, fill_masks

    compiler = PagedEngine(loaded, EngineConfig(max_num_seqs=2)).grammars()
    person = ConstraintSpec("json_schema", schema=json.dumps(PERSON))
    specs = [person, ConstraintSpec("json_object")]
    guides = [compiler.guide(specs[i % 2]) for i in range(6)]
    for steps, guide in enumerate(guides):
        for token in loaded.tokenizer.encode('{"name": "Ann', add_special_tokens=False)[:steps]:
            assert guide.consume(token)
    done = compiler.guide(ConstraintSpec("json_object"))
    for token in loaded.tokenizer.encode("{}", add_special_tokens=False):
        assert done.consume(token)
    guides.append(done)
    width = (compiler.vocab_size + 31) // 32
    filler = MaskFiller()
    for _ in range(3):
        inline = np.zeros((len(guides), width), dtype=np.int32)
        fill_masks(guides, inline)
        threaded = np.zeros_like(inline)
        filler.start(guides, threaded)
        with pytest.raises(RuntimeError, match="already running"):
            filler.start(guides, np.zeros_like(inline))
        filler.wait()
        assert (threaded == inline).all()
        assert (inline[-1] == -1).all()  # a complete answer's row allows everything
        assert len({row.tobytes() for row in inline}) > 2
    filler.close()
    with pytest.raises(RuntimeError, match="closed"):
        filler.start(guides, np.zeros((len(guides), width), dtype=np.int32))


def test_a_step_that_fails_while_masks_fill_leaves_the_filler_free(loaded: LoadedModel) -> None:
    """The async engine applies step N while step N+1's masks fill on the filler thread; if
    that fails, the step's error surfaces and the filler is not left holding a fill, so the
    site (which fails the requests it held and goes on, engine_service) can serve the next
    constrained request."""
    spec = ConstraintSpec("json_schema", schema=json.dumps(PERSON))
    site = engine(loaded, True)
    site.add_request(constrained(loaded, "first", spec))
    scheduler = site._scheduler
    real_update = scheduler.update
    calls = {"n": 0}

    def failing_update(*args: object, **kwargs: object) -> object:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("update failed")
        return real_update(*args, **kwargs)  # type: ignore[arg-type]

    scheduler.update = failing_update  # type: ignore[method-assign,assignment]

    def steps() -> None:
        for _ in range(10):
            site.step()

    with pytest.raises(RuntimeError, match="update failed"):
        steps()
    filler = site.runner.sampler._filler
    assert filler is not None
    assert not filler._busy
    site.close()
