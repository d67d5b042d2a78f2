"""Bounded admission: the gateway's in-flight cap, its backlog of unwritten outcomes, and a site's
queue as routing sees it."""

from __future__ import annotations

import asyncio
import functools
import gc
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest

from gateway.api.openai_errors import OpenAIError, to_openai
from gateway.db.models import RequestStatus
from gateway.db.session import create_engine, create_sessionmaker
from gateway.errors import GatewayError
from gateway.federation import ModelConfig, SiteConfig
from gateway.prediction.by_model import ModelPredictors
from gateway.prediction.service import PredictorService
from gateway.request_path.admit import Admitter, InFlightBound
from gateway.request_path.prepare import Delivery, Sampling
from gateway.request_path.service import CompletionService
from gateway.routing.policy import build_policy
from gateway.settings import GatewaySettings, LimitsSettings
from gateway.sites.grpc_client import GrpcSiteClient
from gateway.sites.interface import LoadView, SiteInfoView
from gateway.sites.lease import SiteLease
from gateway.sites.registry import SiteRegistry, SiteState
from gateway.stores.request_log import Outcome, RequestLog
from gateway.tokenizers import ModelTokenizers


def test_the_cap_refuses_with_429_and_retry_after_then_frees_slots() -> None:
    bound = InFlightBound(limit=2)
    bound.enter()
    bound.enter()
    with pytest.raises((OpenAIError, GatewayError)) as refused:
        bound.enter()
    assert (to_openai(refused.value).status, to_openai(refused.value).retry_after_s) == (429, 1)
    assert to_openai(refused.value).body.code == "gateway_overloaded"
    bound.leave()
    bound.enter()
    assert (bound.in_flight, bound.refused) == (2, 1)


def test_a_prompt_list_takes_a_slot_per_prompt_all_or_none() -> None:
    bound = InFlightBound(limit=4)
    bound.enter(2)
    with pytest.raises((OpenAIError, GatewayError)):
        bound.enter(3)  # two free: the list of three takes none of them
    assert bound.in_flight == 2
    bound.enter(2)
    bound.leave(4)
    assert bound.in_flight == 0


class KeyHold:
    """A key's admission as dispatch sees it (gateway/tenancy/admission.py's KeyAdmission)."""

    api_key_id = 7
    api_key_name = "k7"

    def __init__(self) -> None:
        self.settled: list[int] = []
        self.stop: Callable[[], None] | None = None

    async def charge(self, tokens: int, most_tokens: int) -> None:
        pass

    def settle(self, tokens: int) -> None:
        self.settled.append(tokens)

    def watch_revocation(self, stop: Callable[[], None]) -> None:
        self.stop = stop


def test_a_prompt_lists_admission_is_settled_once_with_every_prompts_tokens() -> None:
    whole = KeyHold()
    parts = Admitter.parts(whole, 3)
    assert Admitter.parts(whole, 1) == [whole]
    stopped: list[int] = []
    for number, part in enumerate(parts):
        assert part is not None
        assert part.api_key_id == 7
        part.watch_revocation(functools.partial(stopped.append, number))
        part.settle(10 + number)
        assert whole.settled == ([] if number < 2 else [33])
    assert whole.stop is not None
    whole.stop()  # the key is revoked: every prompt is stopped
    assert stopped == [0, 1, 2]


def test_a_slot_tied_to_an_object_comes_back_when_the_object_goes() -> None:
    """What CompletionService.dispatch does for a stream that is never consumed."""

    class Holder:
        pass

    bound = InFlightBound(limit=1)
    bound.enter()
    holder = Holder()
    slot = weakref.finalize(holder, bound.leave)
    del holder
    gc.collect()
    assert bound.in_flight == 0
    slot()  # already run: calling it again gives nothing back twice
    assert bound.in_flight == 0


def _report(queued: int) -> LoadView:
    return LoadView(queued, 1, queued * 10, 0, 0, 0, 100, 0.0, 1, 1)


def _info(slots: int) -> SiteInfoView:
    return SiteInfoView("a", "m", 1024, 100, "f", "cpu", "float32", 16, 64, slots, "e", "v")


@pytest.mark.parametrize(
    ("report", "slots", "in_flight", "placed", "queued"),
    [
        (None, None, 5, 5, 0),  # nothing known yet
        (_report(3), None, 0, 0, 3),  # the site's own report
        (None, 2, 5, 5, 3),  # this gateway alone sent 3 beyond the site's 2 slots
        # 1 running + 1 waiting reported, 3 placed since: 3 beyond the 2 slots.
        (_report(1), 2, 5, 3, 3),
        (_report(4), 2, 5, 0, 4),
        # Issue 74: 5 still in flight here, but the site says it holds 2 (the others' last
        # tokens are on their way) and nothing was placed since: its queue is its report's.
        (_report(1), 2, 5, 0, 1),
    ],
)
def test_a_sites_queue_as_routing_sees_it(report, slots, in_flight, placed, queued) -> None:
    async def check() -> None:
        client = GrpcSiteClient("a", "127.0.0.1:1", 1.0)  # never called: only the state is read
        try:
            site = SiteState(
                SiteConfig("a", "aws", "r", "127.0.0.1:1", "m"),
                1,
                client,
                info=_info(slots) if slots is not None else None,
                in_flight=in_flight,
                placed=placed,
                report=report,
            )
            assert site.queued_requests == queued
            assert site.queued_tokens == (report.queued_prompt_tokens if report else 0)
        finally:
            await client.close()

    asyncio.run(check())


def test_a_full_site_whose_slots_turn_over_shows_no_queue_it_does_not_have() -> None:
    """Issue 74: a site of 4 slots reports 4 running and none waiting; in the next two report
    intervals this gateway places 3 more and 3 of its requests there end. The site still holds
    4: no queue. Counting the placements alone made it 3 deep (at 1,024 streams, hundreds deep:
    requests were refused `queue_bound` while the site had free slots). A burst that outruns
    the turnover still shows as a queue."""

    async def check() -> None:
        client = GrpcSiteClient("a", "127.0.0.1:1", 1.0)  # never called: only the state is read
        try:
            site = SiteState(
                SiteConfig("a", "aws", "r", "127.0.0.1:1", "m"), 1, client, info=_info(4)
            )
            leases = [SiteLease.take(site, 10) for _ in range(4)]
            full = LoadView(0, 4, 0, 0, 0, 0, 100, 0.0, 1, 1)
            site.apply_report(full)
            site.apply_report(full)  # the 4 are surely in this one
            assert (site.unreported, site.queued_requests) == (0, 0)
            for lease in leases[:3]:
                lease.release()
            leases += [SiteLease.take(site, 10) for _ in range(3)]
            assert (site.unreported, site.queued_requests) == (0, 0)
            leases += [SiteLease.take(site, 10) for _ in range(2)]  # a burst beyond the turnover
            assert (site.unreported, site.queued_requests) == (2, 2)
            site.apply_report(LoadView(2, 4, 0, 0, 0, 0, 100, 0.0, 2, 2))
            site.apply_report(LoadView(2, 4, 0, 0, 0, 0, 100, 0.0, 3, 3))
            assert (site.unreported, site.queued_requests) == (0, 2)
            for lease in leases[3:]:
                lease.release()  # 6 left, none placed: the site empties
            assert site.unreported == -6
            assert site.requests_at_site == 0
        finally:
            await client.close()

    asyncio.run(check())


def test_new_requests_wait_while_unwritten_outcomes_fill_their_backlog(
    gpt2_tokenizer_dir: Path,
) -> None:
    """Accepted work is never dropped: while the backlog of outcomes the database has not taken
    is full, the gateway takes no new request (503 with Retry-After) instead of dropping one."""
    settings = GatewaySettings(
        federation_file=Path("unused.json"), limits=LimitsSettings(outcome_backlog_max=1)
    )
    # A database without tables: every outcome write fails and waits.
    unwritable = RequestLog(create_sessionmaker(create_engine("sqlite+aiosqlite://")))
    service = CompletionService(
        settings,
        SiteRegistry([]),
        ModelTokenizers((ModelConfig("m", gpt2_tokenizer_dir),)),
        build_policy("round_robin"),
        unwritable,
    )
    prepared = service.preparer.prepare_tokens(
        "m", [1, 2], "hi", Sampling(max_tokens=2), Delivery()
    )

    async def run() -> None:
        backlog = service.records.writer
        backlog.finished("earlier", Outcome(RequestStatus.COMPLETED, None, 1, 2))
        assert backlog.full
        with pytest.raises((OpenAIError, GatewayError)) as refused:
            await service.dispatch(prepared)
        error = to_openai(refused.value)
        assert (error.status, error.retry_after_s) == (503, 1)
        assert "request log is behind" in error.body.message
        assert service.admitter.bound.in_flight == 0  # refused before taking a slot
        await backlog.drain(timeout_s=0.1)

    asyncio.run(run())


class RecordsAlone(ModelPredictors):
    """Predicts nothing; remembers whether each request was said to be alone in the gateway."""

    def __init__(self) -> None:
        super().__init__(PredictorService(None))
        self.alone: list[bool] = []

    async def predict(self, model: str, prompt: str, *, alone: bool = False) -> None:
        self.alone.append(alone)


@pytest.mark.parametrize(("others_in_flight", "alone"), [(0, True), (1, False), (5, False)])
def test_the_predictor_hears_whether_a_request_is_alone(
    gpt2_tokenizer_dir: Path, others_in_flight: int, alone: bool
) -> None:
    """A lone request's prompt may be predicted on the event loop (gateway/prediction/service.py):
    only when the in-flight bound holds no other request."""
    predictors = RecordsAlone()
    service = CompletionService(
        GatewaySettings(federation_file=Path("unused.json")),
        SiteRegistry([]),
        ModelTokenizers((ModelConfig("m", gpt2_tokenizer_dir),)),
        build_policy("round_robin"),
        RequestLog(create_sessionmaker(create_engine("sqlite+aiosqlite://"))),
        predictors,
    )
    prepared = service.preparer.prepare_tokens(
        "m", [1, 2], "hi", Sampling(max_tokens=2), Delivery()
    )
    service.admitter.bound.in_flight = others_in_flight

    async def run() -> None:
        with pytest.raises((OpenAIError, GatewayError)):  # no site to route to: 503
            await service.dispatch(prepared)
        await service.records.writer.drain(timeout_s=0.1)

    asyncio.run(run())
    assert predictors.alone == [alone]


def test_requests_placed_before_the_report_before_last_count_as_reported() -> None:
    async def check() -> None:
        client = GrpcSiteClient("a", "127.0.0.1:1", 1.0)  # never called: only the state is read
        try:
            site = SiteState(
                SiteConfig("a", "aws", "r", "127.0.0.1:1", "m"), 1, client, info=_info(2)
            )
            for _ in range(3):
                SiteLease.take(site, 10)
            site.apply_report(_report(1))  # may have been sent before the 3 arrived
            assert (site.unreported, site.queued_requests) == (3, 3)
            site.apply_report(_report(1))  # sent a report interval after: it counts them
            assert (site.unreported, site.queued_requests) == (0, 1)
            SiteLease.take(site, 10)
            assert (site.unreported, site.queued_requests) == (1, 1)
        finally:
            await client.close()

    asyncio.run(check())
