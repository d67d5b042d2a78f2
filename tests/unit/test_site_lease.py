"""A request's place in its site's counters (gateway/sites/lease.py): taken, recharged, moved and
released, each exactly once; and a dispatch that holds one while its answer moves to another
site mid-stream (gateway/dispatch/stream.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from pathlib import Path

import pytest

from gateway.db.session import create_engine, create_sessionmaker
from gateway.federation import ModelConfig, SiteConfig
from gateway.request_path.prepare import Delivery, Sampling
from gateway.request_path.service import CompletionService
from gateway.routing.policy import build_policy
from gateway.settings import GatewaySettings
from gateway.sites.interface import (
    Capability,
    EmbedParams,
    EmbedResult,
    GenerateParams,
    HealthAnswer,
    LoadView,
    SiteChunk,
    SiteClient,
    SiteFailed,
    SiteInfoView,
)
from gateway.sites.lease import SiteLease
from gateway.sites.registry import SiteRegistry, SiteState
from gateway.stores.request_log import RequestLog
from gateway.tokenizers import ModelTokenizers


def _site(name: str, client: SiteClient | None = None) -> SiteState:
    config = SiteConfig(name, "aws", "r", "127.0.0.1:1", "m")
    info = SiteInfoView(name, "m", 1024, 50257, "f", "cpu", "float32", 16, 256, 8, "e", "v")
    client = client or ScriptedSite(name, [], dies=False)  # never called
    return SiteState(config, ord(name), client, healthy=True, info=info)


def _counts(*sites: SiteState) -> list[tuple[int, int]]:
    return [(site.in_flight, site.ledger_tokens) for site in sites]


def test_a_lease_counts_from_its_taking_and_gives_back_exactly_once() -> None:
    site = _site("a")
    other = SiteLease.take(site, 7)  # another request on the same site
    lease = SiteLease.take(site, 100)
    assert _counts(site) == [(2, 107)]
    lease.recharge(60)  # answer tokens streamed back
    assert _counts(site) == [(2, 67)]
    lease.release()
    assert _counts(site) == [(1, 7)]
    lease.release()  # twice (a finalizer after the normal path): nothing more
    lease.recharge(500)  # a released lease charges nothing
    assert _counts(site) == [(1, 7)]
    other.release()
    assert _counts(site) == [(0, 0)]


def test_a_moved_lease_leaves_one_site_and_counts_on_the_next_in_one_step() -> None:
    a, b = _site("a"), _site("b")
    lease = SiteLease.take(a, 40)
    lease.move(b, 25)  # a continuation: the prompt grew, the answer left shrank
    assert _counts(a, b) == [(0, 0), (1, 25)]
    assert (lease.site, lease.held) == (b, True)
    lease.release()
    lease.move(a, 30)  # taken again after a release (the next attempt of a dispatch)
    assert _counts(a, b) == [(1, 30), (0, 0)]
    lease.move(a, 10)  # onto the site it holds: replaced, not counted twice
    assert _counts(a, b) == [(1, 10), (0, 0)]
    # Nor as a request that left the site and came back (routing's turnover, issue 74).
    assert (a.placed, a.left) == (2, 1)
    lease.release()
    assert _counts(a, b) == [(0, 0), (0, 0)]


class ScriptedSite:
    """A site that streams the given answer tokens, then fails (when told to) instead of
    finishing: what a site that dies mid-answer looks like to dispatch."""

    can_release_queued = False
    capabilities: frozenset[Capability] = frozenset()

    def __init__(self, name: str, tokens: list[tuple[int, str]], *, dies: bool) -> None:
        self.name, self._tokens, self._dies = name, tokens, dies
        self.asked: list[GenerateParams] = []

    async def generate(
        self, params: GenerateParams, timeout_s: float
    ) -> AsyncGenerator[SiteChunk, None]:
        self.asked.append(params)
        for number, (token, text) in enumerate(self._tokens, start=1):
            last = number == len(self._tokens) and not self._dies
            yield SiteChunk(True, (token,), text, "length" if last else None, 0, number)
        if self._dies:
            raise SiteFailed(self.name, "the site died")

    async def embed(self, params: EmbedParams, timeout_s: float) -> EmbedResult:
        raise NotImplementedError

    async def cancel(self, request_id: str) -> bool:
        return False

    async def check_health(self) -> HealthAnswer:
        raise NotImplementedError

    async def info(self) -> SiteInfoView:
        raise NotImplementedError

    def load_reports(
        self, interval_ms: int, cache_events: bool = False
    ) -> AsyncGenerator[LoadView, None]:
        raise NotImplementedError

    async def release_queued(self, max_requests: int) -> list[str]:
        raise NotImplementedError

    async def close(self) -> None:
        pass


def test_a_dispatch_moves_its_lease_with_a_continued_answer(gpt2_tokenizer_dir: Path) -> None:
    """Counted on the first site from its creation, on the second once the answer continues
    there (never on both, never on neither between two chunks), and on none at the end."""
    tokenizers = ModelTokenizers((ModelConfig("m", gpt2_tokenizer_dir),))
    ids = tokenizers.encode("m", " one two three four five six")
    pieces = [(token, tokenizers.decode("m", [token])) for token in ids]
    first = ScriptedSite("a", pieces[:3], dies=True)
    second = ScriptedSite("b", pieces[3:], dies=False)
    a, b = _site("a", first), _site("b", second)
    service = CompletionService(
        GatewaySettings(federation_file=Path("unused.json")),
        SiteRegistry([a, b]),
        tokenizers,
        build_policy("least_requests"),
        RequestLog(create_sessionmaker(create_engine("sqlite+aiosqlite://"))),
    )
    prompt = tokenizers.encode("m", "Count to six:")
    sampling = Sampling(max_tokens=len(ids))
    prepared = service.preparer.prepare_tokens("m", prompt, "Count", sampling, Delivery())

    async def run() -> None:
        dispatch = service.open_dispatch(prepared, a)
        charge = len(prompt) + len(ids)  # prompt + the planned answer (max_tokens: unpredicted)
        assert _counts(a, b) == [(1, charge), (0, 0)]
        seen: list[list[tuple[int, int]]] = []
        text = ""
        async for chunk in dispatch.events():
            text += chunk.text
            seen.append(_counts(a, b))
            dispatch.abandon()  # the stream has begun: its place is the stream's to give back
        assert text == " one two three four five six"
        assert [c.as_json() for c in dispatch.continuations] == [
            {"from": "a", "to": "b", "after_tokens": 3}
        ]
        assert second.asked[0].prompt_token_ids == (*prompt, *ids[:3])
        # On a: the ledger counts down as the answer streams. Then b holds the rest: its prompt
        # holds the 3 tokens a produced, and the answer left counts down from there.
        assert seen[:3] == [[(1, charge - n), (0, 0)] for n in (1, 2, 3)]
        assert seen[3:] == [[(0, 0), (1, charge + 3 - n)] for n in (4, 5, 6)]
        assert _counts(a, b) == [(0, 0), (0, 0)]
        await service.records.writer.drain(timeout_s=0.1)

    asyncio.run(run())


@pytest.mark.parametrize("streamed", [False, True])
def test_an_abandoned_dispatch_gives_its_place_back_once(
    gpt2_tokenizer_dir: Path, streamed: bool
) -> None:
    tokenizers = ModelTokenizers((ModelConfig("m", gpt2_tokenizer_dir),))
    ids = tokenizers.encode("m", " one two")
    pieces = [(token, tokenizers.decode("m", [token])) for token in ids]
    a = _site("a", ScriptedSite("a", pieces, dies=False))
    service = CompletionService(
        GatewaySettings(federation_file=Path("unused.json")),
        SiteRegistry([a]),
        tokenizers,
        build_policy("least_requests"),
        RequestLog(create_sessionmaker(create_engine("sqlite+aiosqlite://"))),
    )
    prepared = service.preparer.prepare_tokens(
        "m", [1, 2], "hi", Sampling(max_tokens=2), Delivery()
    )

    async def run() -> None:
        dispatch = service.open_dispatch(prepared, a)
        if streamed:
            async for _ in dispatch.events():
                pass
        dispatch.abandon()
        dispatch.abandon()
        assert _counts(a) == [(0, 0)]
        await service.records.writer.drain(timeout_s=0.1)

    asyncio.run(run())
