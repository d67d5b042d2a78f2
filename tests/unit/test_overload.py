"""Bounded admission: the gateway's in-flight cap, and a site's queue as routing sees it."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from gateway.api.errors import OpenAIError
from gateway.overload import InFlightBound
from gateway.sites.client import LoadView, SiteClient, SiteInfoView
from gateway.sites.config import SiteConfig
from gateway.sites.registry import SiteState


def test_the_cap_refuses_with_429_and_retry_after_then_frees_slots() -> None:
    bound = InFlightBound(limit=2)
    bound.enter()
    bound.enter()
    with pytest.raises(OpenAIError) as refused:
        bound.enter()
    assert (refused.value.status, refused.value.retry_after_s) == (429, 1)
    assert refused.value.body.code == "gateway_overloaded"
    bound.leave()
    bound.enter()
    assert (bound.in_flight, bound.refused) == (2, 1)


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
    ("report", "slots", "in_flight", "queued"),
    [
        (None, None, 5, 0),  # nothing known yet
        (_report(3), None, 0, 3),  # the site's own report
        (None, 2, 5, 3),  # this gateway alone sent 3 beyond the site's 2 slots
        (_report(1), 2, 5, 3),  # the larger of both
        (_report(4), 2, 5, 4),
    ],
)
def test_a_sites_queue_as_routing_sees_it(report, slots, in_flight, queued) -> None:
    async def check() -> None:
        client = SiteClient("a", "127.0.0.1:1", 1.0)  # never called: only the state is read
        try:
            site = SiteState(
                SiteConfig("a", "aws", "r", "127.0.0.1:1", "m"),
                1,
                client,
                info=_info(slots) if slots is not None else None,
                in_flight=in_flight,
                report=report,
            )
            assert site.queued_requests == queued
            assert site.queued_tokens == (report.queued_prompt_tokens if report else 0)
        finally:
            await client.close()

    asyncio.run(check())
