"""A site whose machine lacks llguidance (the bare GPU image has none, and its pinned wheel is
not built for it) still starts and serves: constrained requests are refused with the reason, the
rest is answered. Before, the site built the grammar compiler at start-up and exited on the
ImportError, which failed every `tests/gpu/test_site_gpu.py` case on the H100 of 2026-11-27.
Hidden here by putting None in sys.modules for llguidance, as an interpreter without it sees it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from fedllm_contract.grammar import ConstraintSpec
from site_engine.engine.core.api import (
    EngineRequest,
    RequestOutput,
    StructuredOutputUnavailable,
)
from site_engine.engine.core.types import FinishReason, SamplingParams
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.model_loading import load_model
from site_engine.pool import prepare
from site_engine.settings import SiteSettings

PROMPT = (1, 2, 3, 4, 5, 6, 7, 8)
SCHEMA = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'


@pytest.fixture
def without_llguidance(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in sys.modules if n == "llguidance" or n.startswith("llguidance.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delitem(sys.modules, "site_engine.engine.grammar_compiler", raising=False)
    monkeypatch.setitem(sys.modules, "llguidance", None)


def test_constrained_requests_are_refused_and_the_rest_served(
    tiny_llama_dir: Path, without_llguidance: None
) -> None:
    engine = PagedEngine(load_model(tiny_llama_dir, device="cpu"), EngineConfig(max_num_seqs=2))
    with pytest.raises(StructuredOutputUnavailable, match="llguidance is not installed"):
        engine.grammars()
    spec = ConstraintSpec("json_schema", schema=SCHEMA)
    constrained = SamplingParams(8, temperature=0.0, constraint=spec)
    with pytest.raises(StructuredOutputUnavailable):
        engine.add_request(EngineRequest("json", PROMPT, constrained))
    engine.add_request(EngineRequest("free", PROMPT, SamplingParams(4, temperature=0.0)))
    outputs: list[RequestOutput] = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert [o.request_id for o in outputs if o.finish_reason is not None] == ["free"]
    assert sum(len(o.new_token_ids) for o in outputs) == 4
    assert outputs[-1].finish_reason in (FinishReason.LENGTH, FinishReason.STOP)


def test_a_pooled_process_prepares_without_a_grammar_compiler(
    tiny_llama_dir: Path, tmp_path: Path, without_llguidance: None
) -> None:
    settings = SiteSettings(model_dir=tiny_llama_dir, site_name="s", model_name="m")
    prepared = prepare(settings, tmp_path / "plans.json")
    assert prepared.grammars is None
    assert prepared.loaded.vocab_size > 0
