"""The site end of the chunk pacing (fedsim/site_writer.py) and the client's view of text
(fedsim/serving_path.py's has_text, SiteSpec.text_share), alone and in a federation run."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from bench.federation_real.sim import text_share
from fedsim.events import EventLoop
from fedsim.federation import RunResult, run
from fedsim.gateway import GatewaySettings
from fedsim.serving_path import ServingCosts, has_text
from fedsim.site import SimSite
from fedsim.site_writer import SiteWriter
from fedsim.workload import SimRequest
from site_engine.engine.core.outputs import StepOutputs
from site_engine.engine.core.types import FinishReason
from tests.unit.fedsim.test_fedsim import _spec


def _writer() -> tuple[EventLoop, SiteWriter, list[tuple[float, str, int, bool]]]:
    loop = EventLoop()
    sent: list[tuple[float, str, int, bool]] = []
    writer = SiteWriter(loop, lambda rid, n, last: sent.append((loop.now(), rid, n, last)))
    return loop, writer, sent


def _step(loop: EventLoop, writer: SiteWriter, at: float, finish: bool = False) -> None:
    def deliver() -> None:
        writer.tokens("a", 1, finish)
        writer.wake()

    loop.at(at, deliver)


def test_the_site_holds_an_answer_for_the_interval_first_token_and_end_at_once() -> None:
    loop, writer, sent = _writer()
    writer.told(0.025)  # 25 ms: the timer looks again every 6.25 ms
    for at in (0.0, 0.01, 0.02, 0.03, 0.04, 0.05):  # a step every 10 ms
        _step(loop, writer, at)
    _step(loop, writer, 0.052, finish=True)
    loop.run(1.0)
    # The first at once; the next two held until 25 ms after it and sent at the first wake then
    # (the timer's: armed at 10 ms, every 6.25 ms while held, so at 28.75 ms); the next three
    # until 53.75 ms, but the end comes first and takes them with it.
    assert [(round(t, 5), n, last) for t, _, n, last in sent] == [
        (0.0, 1, False),
        (0.02875, 2, False),
        (0.052, 4, True),
    ]


def test_a_step_s_wake_sends_what_is_due_and_the_timer_has_a_floor() -> None:
    loop, writer, sent = _writer()
    writer.told(0.004)  # a quarter is 1 ms: the timer waits its 2 ms floor
    for at in (0.0, 0.001, 0.0045):
        _step(loop, writer, at)
    loop.run(1.0)
    # 1 ms: held (due at 4 ms); the timer at 3 ms finds it still held, at 5 ms... the step at
    # 4.5 ms came first and sent both.
    assert [(round(t, 5), n) for t, _, n, _ in sent] == [(0.0, 1), (0.0045, 2)]


def test_the_interval_is_capped_and_released_rows_and_a_dead_site_send_nothing() -> None:
    loop, writer, sent = _writer()
    writer.told(5.0)
    assert writer.interval_s == 1.0  # the site honours at most a second
    updates = StepOutputs()
    updates.add("a", 7)
    updates.add("b", finish=FinishReason.RELEASED)
    writer.step(updates)
    assert [(rid, n) for _, rid, n, _ in sent] == [("a", 1)]
    writer.tokens("a", 1, False)
    writer.wake()  # held for the second
    writer.clear()
    loop.run(5.0)
    assert len(sent) == 1


def test_a_chunk_shows_text_at_the_share_a_token_carries_it() -> None:
    rng = random.Random(1)
    assert has_text(rng, 1.0, 3)
    assert not has_text(rng, 1.0, 0)
    assert not has_text(rng, 0.4, 0)
    for tokens in (1, 3):
        share = sum(has_text(rng, 0.4, tokens) for _ in range(20_000)) / 20_000
        assert share == pytest.approx(1 - 0.6**tokens, abs=0.015)


def test_the_twin_s_text_share_is_the_tokenizer_over_the_model_s_vocabulary() -> None:
    assert text_share({"shape": "llama8b"}, 50_257) == pytest.approx(50_257 / 128_256)
    assert text_share({"shape": "tiny"}, 50_257) == pytest.approx(50_257 / 50_304)
    assert text_share({"shape": "tiny"}, 60_000) == 1.0
    assert text_share({"shape": "unknown"}, 50_257) == 1.0
    with pytest.raises(ValueError, match="text_share"):
        dataclasses.replace(_spec("a", 0.01), text_share=0.0)


def _requests(count: int = 40) -> list[SimRequest]:
    rng = random.Random(5)
    out, at = [], 0.0
    for i in range(count):
        at += rng.expovariate(20.0)
        out.append(SimRequest(f"r{i}", at, tuple(range(1000 + 40 * i, 1016 + 40 * i)), 30, 30))
    return out


def _run(share: float, chunks_per_s: float) -> RunResult:
    specs = [dataclasses.replace(_spec("a", 0.01), text_share=share)]
    costs = ServingCosts(request_s=0.0, chunk_s=0.0, token_s=0.0, chunks_per_s=chunks_per_s)
    return run(specs, _requests(), GatewaySettings(policy="round_robin", serving=costs))


def test_in_a_federation_the_site_paces_chunks_and_textless_first_tokens_delay_ttft() -> None:
    free = _run(1.0, 0.0)  # no budget: a chunk a step
    paced = _run(1.0, 100.0)  # ~10 streams: a chunk every ~0.1 s, ~10 steps of tokens
    assert free.completed == paced.completed == 40
    tokens = sum(o.produced for o in free.outcomes)
    assert free.gateway_chunks == free.client_chunks == tokens
    assert paced.gateway_chunks < tokens / 4
    # The first tokens are never held, at either end.
    assert paced.ttft_p50 == pytest.approx(free.ttft_p50, abs=0.002)
    # A random model whose tokens carry text 40% of the time: the client's first token is the
    # first chunk with text, and it counts only those chunks.
    textless = _run(0.4, 100.0)
    assert textless.ttft_p50 > paced.ttft_p50 + 0.01
    assert textless.client_chunks < textless.gateway_chunks
    assert [o.produced for o in textless.outcomes] == [o.produced for o in paced.outcomes]


def test_a_served_site_s_steps_take_its_step_scale_times_the_model_s() -> None:
    loop = EventLoop()
    seen: list[float] = []
    bare, served = _spec("a", 0.01), dataclasses.replace(_spec("a", 0.01), step_scale=1.25)
    for spec in (bare, served):
        site = SimSite(spec, loop, lambda s, _: seen.append(s.busy_s))
        site.add("r", tuple(range(100, 140)), 3, 3, None)
        loop.run(loop.now() + 10.0)
        seen.append(-1.0)
    bare_s, served_s = seen[seen.index(-1.0) - 1], seen[-2]
    assert served_s == pytest.approx(1.25 * bare_s)
    with pytest.raises(ValueError, match="step_scale"):
        dataclasses.replace(bare, step_scale=0.0)


def test_a_site_process_s_token_floor_holds_a_step_to_its_tokens_times_the_floor() -> None:
    def step_lengths(floor_s: float) -> list[tuple[int, float]]:
        """(tokens, seconds) of every step of 12 requests at once, the floor `floor_s`."""
        loop = EventLoop()
        seen: list[tuple[int, float]] = []
        spec = dataclasses.replace(_spec("a", 0.01), token_floor_s=floor_s)

        def note(site: SimSite, updates: StepOutputs) -> None:
            seen.append((len(updates), site.busy_s))

        site = SimSite(spec, loop, note)
        for i in range(12):
            site.add(f"r{i}", tuple(range(100 + 50 * i, 116 + 50 * i)), 20, 20, None)
        loop.run(loop.now() + 30.0)
        return [(n, b - a) for (_, a), (n, b) in itertools.pairwise(seen)]

    bare, floored = step_lengths(0.0), step_lengths(5e-3)
    assert max(n for n, _ in floored) > 1
    assert all(t >= n * 5e-3 - 1e-12 for n, t in floored)
    assert max(t for _, t in bare) < max(n for n, _ in floored) * 5e-3  # the floor decides there
    with pytest.raises(ValueError, match="token_floor_s"):
        dataclasses.replace(_spec("a", 0.01), token_floor_s=-1.0)
