"""The health monitor's decisions over scripted check answers: definite failures act at once,
checks without an answer only after GATEWAY_HEALTH_FAILURES_TO_DOWN in a row, one answered
check heals, and stalled load reports alone never take a site down."""

from __future__ import annotations

import asyncio
from typing import cast

import pytest

from gateway.federation import SiteConfig
from gateway.sites.health import HealthMonitor
from gateway.sites.interface import (
    HealthAnswer,
    SiteCallError,
    SiteClient,
    SiteInfoView,
    SiteUnavailable,
)
from gateway.sites.registry import SiteRegistry, SiteState

S, N, R, X = (
    HealthAnswer.SERVING,
    HealthAnswer.NO_ANSWER,
    HealthAnswer.REFUSED,
    HealthAnswer.NOT_SERVING,
)


def _info(model: str = "m") -> SiteInfoView:
    return SiteInfoView("a", model, 1024, 50257, "f", "cpu", "float32", 16, 256, 8, "e", "v")


class ScriptedChecks:
    """Answers each check with the next scripted answer; info() with the next scripted info (an
    exception is raised)."""

    name = "a"

    def __init__(self, answers: list[HealthAnswer], infos: list[object] | None = None) -> None:
        self.answers = list(answers)
        self.infos = list(infos or [])

    async def check_health(self) -> HealthAnswer:
        return self.answers.pop(0)

    async def info(self) -> SiteInfoView:
        item = self.infos.pop(0) if self.infos else _info()
        if isinstance(item, SiteCallError):
            raise item
        return cast(SiteInfoView, item)


def _run(
    answers: list[HealthAnswer],
    failures_to_down: int,
    infos: list[object] | None = None,
    stale: bool = False,
) -> list[bool]:
    """The site's health after each check."""
    site = SiteState(
        SiteConfig("a", "aws", "r", "127.0.0.1:1", "m"),
        1,
        cast(SiteClient, ScriptedChecks(answers, infos)),
    )
    monitor = HealthMonitor(
        SiteRegistry([site]), {}, 1.0, lambda _s: stale, failures_to_down=failures_to_down
    )
    seen = []
    for _ in answers:
        asyncio.run(monitor.check(site))
        seen.append(site.healthy)
    return seen


def test_unanswered_checks_take_a_healthy_site_down_only_after_enough_in_a_row() -> None:
    assert _run([S, N, N, S, N, N, N, N], 3) == [True, True, True, True, True, True, False, False]


def test_one_answered_check_heals_and_restarts_the_count() -> None:
    assert _run([S, N, N, N, S, N], 3) == [True, True, True, False, True, True]


def test_with_one_failure_to_down_a_single_unanswered_check_acts_as_before() -> None:
    assert _run([S, N, S], 1) == [True, False, True]


@pytest.mark.parametrize("definite", [R, X])
def test_a_refused_or_not_serving_check_acts_at_once(definite: HealthAnswer) -> None:
    assert _run([S, N, definite, S], 3) == [True, True, False, True]


def test_a_site_never_healthy_stays_down_on_unanswered_checks() -> None:
    assert _run([N, N, S], 3) == [False, False, True]


def test_a_model_mismatch_acts_at_once_and_info_unanswered_counts_as_unanswered() -> None:
    late = SiteUnavailable("a", "did not answer in time")
    infos: list[object] = [_info(), _info("other"), _info(), late, late, late]
    assert _run([S, S, S, S, S, S], 3, infos) == [True, False, True, True, True, False]


def test_stalled_load_reports_leave_a_site_that_answers_healthy() -> None:
    assert _run([S, S, S], 3, stale=True) == [True, True, True]


def test_failures_to_down_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="failures_to_down"):
        HealthMonitor(SiteRegistry([]), {}, 1.0, failures_to_down=0)


class _SlowInfo(ScriptedChecks):
    """Its info (no adapters) is held until `release`: a check in flight."""

    def __init__(self) -> None:
        super().__init__([S, S])
        self.asked = asyncio.Event()
        self.release = asyncio.Event()

    async def info(self) -> SiteInfoView:
        self.asked.set()
        await self.release.wait()
        return _info()


def test_a_check_in_flight_keeps_the_adapter_list_a_load_gave_since() -> None:
    # CI (issue 72): a check that asked for info before a fine-tuned model's load answered put
    # the old list back, and the model was missing from /v1/models until the next check.
    client = _SlowInfo()
    site = SiteState(SiteConfig("a", "aws", "r", "127.0.0.1:1", "m"), 1, cast(SiteClient, client))
    site.mark_healthy(_info())
    monitor = HealthMonitor(SiteRegistry([site]), {}, 1.0, lambda _s: False)

    async def scenario() -> None:
        check = asyncio.create_task(monitor.check(site))
        await client.asked.wait()
        site.take_adapters(("ft:m:x",))
        client.release.set()
        await check
        assert site.adapters == {"ft:m:x"}
        client.asked.clear()
        await monitor.check(site)  # asked for after the load: the site's own list counts again
        assert not site.adapters

    asyncio.run(scenario())
