"""The jobs the sites hold, reconciled with the database at the start of each pass of the runner
(issue 67: a job cancelled while its site still parsed its file kept training there, and the
gateway, which had told nobody, showed it cancelled).

Each healthy training site names the jobs it holds live (queued, being read, training), and the
gateway cancels there each one the database does not hold as live at that site:
- one cancelled (or failed) here while the site could not be told: the cancel is sent again
  every pass until the site no longer holds the job, and the job's events say when it was;
- one whose start reached the site after the gateway gave up on it and handed the job to
  another site;
- one the database never had.
A queued job that no site has taken yet is left to the site that holds it (assigned to it, by
the same conditional update as a start), rather than cancelled there and sent again.

The database is written before a job is sent to a site (assigned, then started), so a job a
site names is in the database by the time its name is read there.
"""

from __future__ import annotations

import logging

from gateway.db.models import FineTuningStatus
from gateway.sites.interface import FineTuningSite, SiteCallError, SiteRejected
from gateway.sites.registry import SiteRegistry
from gateway.stores.fine_tuning_store import FineTuningStore

log = logging.getLogger(__name__)


async def reconcile(registry: SiteRegistry, store: FineTuningStore) -> None:
    """One round over the healthy sites that take jobs; a site that does not answer is asked
    again next pass."""
    for site in registry.all():
        client = site.client
        takes_jobs = site.info is not None and site.info.accepts_fine_tuning
        if not (site.healthy and takes_jobs and isinstance(client, FineTuningSite)):
            continue
        try:
            held = await client.live_fine_tunes()
            if held:
                await _reconcile_site(store, site.name, client, held)
        except SiteCallError as exc:
            log.info("fine-tuning: site %s's jobs not reconciled now: %s", site.name, exc)


async def _reconcile_site(
    store: FineTuningStore, name: str, client: FineTuningSite, held: list[str]
) -> None:
    placed = await store.placements(held)
    for job_id in held:
        status, where = placed.get(job_id, (None, None))
        if status is not None and not status.is_final and where == name:
            continue  # live here
        if status is FineTuningStatus.QUEUED and where is None and await store.assign(job_id, name):
            continue  # it trains where it is
        try:
            await client.cancel_fine_tune(job_id)
        except SiteRejected:
            continue  # it ended there meanwhile
        if status is None:
            log.warning("fine-tuning: cancelled job %s at site %s: no such job", job_id, name)
            continue
        why = f"the job is {status.value}" if status.is_final else f"its site is {where}"
        await store.note(job_id, f"Site {name} still held the job ({why}): cancelled there")
        log.warning("fine-tuning: cancelled job %s at site %s (%s)", job_id, name, why)
