"""What the scaling policy sees of a model's sites: each site's work in seconds of its own time.

A site's work is the prompt tokens it has queued over its prefill rate plus the answer tokens
still predicted for its queued and running requests over its decode throughput at a full batch.
Both come from what the gateway already has (gateway/sites/registry.py): the load reports (and
this gateway's ledger when it holds more than the last report shows: a burst routed since), the
step-time line fitted to those reports (a full batch of `max_num_seqs` sequences steps in
t(S) seconds and emits S tokens), and the prefill rate they measure; a site not measured yet
takes its same-model peers' median, and with none measured the scaling rule's prior.

The model's arrivals are this gateway's count of the work it admitted (prompt tokens and the
length predictor's answer tokens of every request, gateway/sites/registry.py's Arrivals); the
policy turns them into seconds of a site's time at the serving sites' median rates.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from statistics import median

from gateway.scaling.policy import ModelObservation, ScalingRule, SiteObservation
from gateway.sites.registry import Arrivals, SiteState


def decode_tokens_per_s(site: SiteState, prior: float) -> float:
    """Tokens per second the site decodes at a full batch (measured, else its peers', else the
    prior)."""
    step = site.step
    slots = site.info.max_num_seqs if site.info is not None else None
    if step is None or not slots:
        return prior
    full = step.at(slots)
    return slots / full if full > 0 else prior


def work_seconds(site: SiteState, rule: ScalingRule) -> float:
    """Seconds of the site's time its queued and running work needs."""
    report = site.report
    queued_prompt = report.queued_prompt_tokens if report is not None else 0
    answers = report.predicted_remaining_tokens if report is not None else 0
    # This gateway's ledger (prompt + planned answer left of its requests there) is ahead of a
    # report when a burst was routed since: what it holds beyond the report is counted as answer.
    reported = queued_prompt + answers + (report.running_tokens if report is not None else 0)
    answers += max(0, site.ledger_tokens - reported)
    return queued_prompt / prefill_tokens_per_s(site, rule) + answers / decode_tokens_per_s(
        site, rule.site_tokens_per_s
    )


def prefill_tokens_per_s(site: SiteState, rule: ScalingRule) -> float:
    """Prompt tokens per second the site prefills (measured or configured, else the prior)."""
    return site.prefill_tokens_per_s or rule.site_prefill_tokens_per_s


def observe(
    rule: ScalingRule,
    sites: Iterable[SiteState],
    removable: Callable[[SiteState], bool],
    pending: int,
    arrivals: Arrivals | None = None,
    start_s: float | None = None,
) -> ModelObservation:
    """The rule's model as the policy sees it (times: the monotonic clock); `start_s`: how long
    the actuator's last start took to serve."""
    mine = [site for site in sites if site.model == rule.model]
    serving = [site for site in mine if site.healthy and not site.draining]
    arrived = arrivals or Arrivals()
    return ModelObservation(
        rule.model,
        tuple(
            SiteObservation(
                name=site.name,
                serving=site.healthy and not site.draining,
                removable=removable(site),
                work_s=work_seconds(site, rule),
                cache_blocks=site.prefix.blocks,
                joined_at=site.joined_at,
            )
            for site in mine
        ),
        pending,
        arrived_prompt_tokens=arrived.prompt_tokens,
        arrived_answer_tokens=arrived.answer_tokens,
        prefill_tokens_per_s=median(prefill_tokens_per_s(s, rule) for s in serving)
        if serving
        else None,
        decode_tokens_per_s=median(decode_tokens_per_s(s, rule.site_tokens_per_s) for s in serving)
        if serving
        else None,
        start_s=start_s,
    )
