"""Runs the fine-tuning jobs: hands each queued job to a site, asks the site for its progress,
writes it (events, checkpoints, trained tokens) and, when the site has trained it, serves its
adapter under the job's model name, private to the key that made the job.

Everything a job is lives in the database, so a restarted gateway goes on from there: it polls
the jobs left running and declares the adapters of succeeded jobs again (their owners; the
sites keep serving them: a loaded adapter is linked into the site's adapter directory), and
loads one no healthy site serves any more from the path its site trained it to.

A queued job goes to the site, of those serving its base that accept jobs (healthy, their
SiteInfo says so and their client is a FineTuningSite), that holds the fewest unfinished jobs.
Several gateways of one database may run this: a job is assigned by a conditional update, a
status changes only from a state that is not final, and a step's event is written once. A job
still `validating_files` (gateway/fine_tuning/service.py) is not handed out; one whose
validation outlived GATEWAY_FINE_TUNING_VALIDATION_TIMEOUT_S (its gateway stopped) fails.

A site answers a start once it has registered the job and reads the files afterwards, so no
deadline bounds a large file; a start whose answer did not come (a deadline passed in transit)
leaves the job assigned, and the next pass asks the site whether it has it before anything is
sent again (issue 67). Each pass begins by reconciling the sites' jobs with the database
(gateway/fine_tuning/reconcile.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable
from datetime import timedelta

from sqlalchemy.exc import IntegrityError

from fedllm_contract.fine_tuning import (
    FineTuneHyperparameters,
    FineTuneProgress,
    FineTuneSpec,
    FineTuneState,
)
from gateway.admin.adapters import AdapterAdmin, LoadAdapterBody
from gateway.db.models import FineTuningStatus, utcnow
from gateway.errors import GatewayError, ServerSideError
from gateway.fine_tuning.reconcile import reconcile
from gateway.metrics import GatewayMetrics
from gateway.model_catalogue import AdapterCatalogue
from gateway.sites.interface import (
    FineTunedAdapterSource,
    FineTuningSite,
    SiteCallError,
    SiteRejected,
)
from gateway.sites.registry import SiteRegistry, SiteState
from gateway.stores.adapter_owners import Ownership
from gateway.stores.file_store import FileStore, NewFile
from gateway.stores.fine_tuning_store import FineTuningStore, JobView

log = logging.getLogger(__name__)
# OpenAI's purpose of a fine-tuning job's result files.
ADAPTER_FILE_PURPOSE = "fine-tune-results"


def fine_tuned_model(job: JobView) -> str:
    """The job's model name: ft:<base>:<suffix>:<id> (OpenAI's ft:<base>:<org>:<suffix>:<id>
    without the organisation, which this gateway does not have; the suffix empty when none)."""
    return f"ft:{job.model}:{job.suffix or ''}:{job.id.removeprefix('ftjob-')}"


def _ownership(job: JobView, name: str) -> Ownership:
    """The job's model is its key's own, by id (made without a key: callers without one)."""
    return Ownership(name, job.model, public=False, key_id=job.owner)


def adapter_file_id(job: JobView) -> str:
    """The file-store id of the job's trained adapter (a tar archive of its files), kept for
    as long as the job: every site of the base loads it from there."""
    return f"file-ftadapter-{job.id.removeprefix('ftjob-')}"


def trainer_of(site: SiteState) -> FineTuningSite | None:
    """The site's trainer, if it takes jobs now (healthy, and says so)."""
    info, client = site.info, site.client
    accepts = info is not None and info.accepts_fine_tuning and not site.draining
    return client if accepts and site.healthy and isinstance(client, FineTuningSite) else None


class FineTuningRunner:
    def __init__(
        self,
        store: FineTuningStore,
        files: FileStore,
        registry: SiteRegistry,
        catalogue: AdapterCatalogue,
        adapters: AdapterAdmin,
        metrics: GatewayMetrics | None = None,
        poll_s: float = 2.0,
        start_timeout_s: float = 3600.0,
        validation_timeout_s: float = 900.0,
    ) -> None:
        self._store = store
        self._files = files
        self._registry = registry
        self._catalogue = catalogue
        self._adapters = adapters
        self._poll_s = poll_s
        self._start_timeout = timedelta(seconds=start_timeout_s)
        self._validation_timeout = timedelta(seconds=validation_timeout_s)
        self._wake = asyncio.Event()
        # Jobs by status as of the last pass (the fine_tuning_jobs gauge).
        self.counts: dict[str, int] = {}
        # Trained models whose site refused to load them again (until this gateway restarts).
        self._unservable: set[str] = set()
        # (model, site): a site that refused a trained model's files (until a restart).
        self._refused: set[tuple[str, str]] = set()
        if metrics is not None:
            metrics.watch_fine_tuning(lambda: self.counts)

    def training_sites(self, base: str) -> list[SiteState]:
        return [s for s in self._registry.all() if s.model == base and trainer_of(s) is not None]

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        """Passes over the unfinished jobs every GATEWAY_FINE_TUNING_POLL_S (or when woken)."""
        while True:
            try:
                await self.run_once()
            except Exception:  # the database may be away for a moment: next time
                log.exception("fine-tuning: a pass over the jobs failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._poll_s)
            self._wake.clear()

    async def run_once(self) -> None:
        await self._serve_succeeded()
        await reconcile(self._registry, self._store)
        jobs = await self._store.unfinished()
        holding: Counter[str] = Counter(job.site for job in jobs if job.site is not None)
        for job in jobs:
            try:
                await self._advance(job, holding)
            except SiteCallError as exc:  # unreachable, or broke under the call: next pass
                log.info("fine-tuning job %s: %s; asking again later", job.id, exc)
            except Exception:  # one job's trouble must not stop the others
                log.exception("fine-tuning job %s: this pass failed", job.id)
        counts = await self._store.count_by_status()
        self.counts = {status.value: counts.get(status, 0) for status in FineTuningStatus}

    async def cancel_at_site(self, job: JobView) -> None:
        """Tells the job's site to stop it (SiteCallError when the site cannot be told)."""
        site = self._registry.get(job.site or "")
        client = site.client if site is not None else None
        if isinstance(client, FineTuningSite):
            await client.cancel_fine_tune(job.id)

    async def _advance(self, job: JobView, holding: Counter[str]) -> None:
        if job.status is FineTuningStatus.VALIDATING_FILES:
            await self._fail_overdue(
                job,
                self._validation_timeout,
                "validation_timeout",
                lambda limit_s: (
                    f"its files were not validated within {limit_s:.0f} s (the "
                    "gateway validating them stopped; GATEWAY_FINE_TUNING_VALIDATION_TIMEOUT_S): "
                    "create the job again"
                ),
            )
            return
        if job.site is None:
            await self._start(job, holding)
            return
        site = self._registry.get(job.site)
        client = site.client if site is not None else None
        if site is None or not isinstance(client, FineTuningSite):
            return  # the site left the federation for now: its job waits for it
        try:
            progress = await client.fine_tune_progress(job.id)
        except SiteRejected as exc:
            if job.status is FineTuningStatus.QUEUED:
                # Assigned, then the start never reached the site (it was lost, or came after
                # its deadline, or this gateway stopped in between): hand it out again.
                await self._store.unassign(job.id, f"site {job.site} does not have the job")
                return
            await self._fail(job, "site_lost_job", f"site {job.site} lost the job: {exc.detail}")
            return
        except SiteCallError:
            if job.status is FineTuningStatus.QUEUED and not site.healthy:
                # Another site may take it; should this one come back holding it, the
                # reconciliation cancels it there.
                why = f"site {job.site} does not answer: the job waits for a site again"
                await self._store.unassign(job.id, why)
                return
            raise
        await self._apply(job, progress)

    async def _start(self, job: JobView, holding: Counter[str]) -> None:
        if await self._fail_overdue(
            job,
            self._start_timeout,
            "no_site_took_job",
            lambda limit_s: (
                f"no site serving {job.model} took the job within {limit_s:.0f} s "
                "(GATEWAY_FINE_TUNING_START_TIMEOUT_S)"
            ),
        ):
            return
        sites = self.training_sites(job.model)
        if not sites:
            return  # waits, queued, for a site that takes jobs of its base
        site = min(sites, key=lambda s: (holding[s.name], s.name))
        trainer = trainer_of(site)
        if trainer is None or not await self._store.assign(job.id, site.name):
            return
        holding[site.name] += 1
        spec = await self._spec(job)
        if spec is None:
            await self._fail(job, "file_not_found", "the training or validation file is gone")
            return
        try:
            progress = await trainer.start_fine_tune(spec)
        except SiteRejected as exc:
            await self._fail(
                job, "site_refused_job", f"site {site.name} refused the job: {exc.detail}"
            )
            return
        except SiteCallError as exc:
            # It may have registered the job all the same (the answer lost, or the deadline
            # passed in transit): the next pass asks it, and sends the job again only if it
            # does not have it. Never sent again blindly (issue 67: a 60 MiB file went out six
            # times in four minutes).
            await self._store.note(
                job.id,
                f"Site {site.name} did not confirm the start ({exc.detail}): it is asked "
                "whether it has the job",
                "warn",
            )
            return
        if progress.state is FineTuneState.CANCELLED:
            # The site cancelled this job before (a start of it there was reconciled away) and
            # never starts it again.
            await self._fail(job, "site_refused_job", f"site {site.name} cancelled the job")
            return
        await self._apply(job, progress)

    async def _spec(self, job: JobView) -> FineTuneSpec | None:
        training = await self._files.content(job.training_file, job.owner)
        validation = None
        if job.validation_file is not None:
            validation = await self._files.content(job.validation_file, job.owner)
            if validation is None:
                return None
        if training is None:
            return None
        hyper = FineTuneHyperparameters(job.n_epochs, job.batch_size, job.learning_rate_multiplier)
        tenant = str(job.owner) if job.owner is not None else ""
        return FineTuneSpec(job.id, job.model, training, validation, hyper, job.seed, tenant)

    async def _apply(self, job: JobView, progress: FineTuneProgress) -> None:
        recorded = await self._store.record(progress)
        if recorded is None:
            return  # final here already (cancelled meanwhile)
        if progress.state is FineTuneState.SUCCEEDED:
            await self._succeed(recorded, progress.adapter_path)
        elif progress.state is FineTuneState.FAILED:
            await self._fail(job, "training_failed", progress.error or "the site failed the job")
        elif progress.state is FineTuneState.CANCELLED:
            await self._store.finish(
                job.id, FineTuningStatus.CANCELLED, f"Fine-tuning job cancelled on site {job.site}"
            )

    async def _fail_overdue(
        self, job: JobView, limit: timedelta, code: str, why: Callable[[float], str]
    ) -> bool:
        """Fails the job with `code` once it has waited longer than `limit` since it was
        created, saying `why` (given the limit's seconds); True when it did."""
        if utcnow() - job.created_at <= limit:
            return False
        await self._fail(job, code, why(limit.total_seconds()))
        return True

    async def _fail(self, job: JobView, code: str, message: str) -> None:
        error = {"code": code, "message": message, "param": None}
        await self._store.finish(
            job.id, FineTuningStatus.FAILED, f"Fine-tuning job failed: {message}", error=error
        )
        log.warning("fine-tuning job %s failed: %s", job.id, message)

    async def _succeed(self, job: JobView, adapter_path: str | None) -> None:
        """Keeps the trained adapter's files in the file store, serves it on every healthy
        site of its base, then marks the job succeeded; a site that cannot be reached now is
        asked again next pass, an adapter no site takes fails the job."""
        if not adapter_path:
            await self._fail(job, "training_failed", "the site named no trained adapter")
            return
        name = fine_tuned_model(job)
        try:
            archive = await self._keep_adapter(job)
            if archive is None:  # a site that cannot hand it over: served where it trained
                await self._load(job, name, adapter_path)
            else:
                await self._spread(job, name, archive)
        except ServerSideError as exc:
            log.info("fine-tuning job %s: adapter not loaded yet: %s", job.id, exc.message)
            return
        except GatewayError as exc:
            await self._fail(job, "adapter_refused", f"the trained adapter: {exc.message}")
            return
        done = await self._store.finish(
            job.id,
            FineTuningStatus.SUCCEEDED,
            f"The job has successfully completed; new fine-tuned model: {name}",
            adapter_path=adapter_path,
            fine_tuned_model=name,
        )
        if not done:  # cancelled meanwhile: its adapter is not served
            with contextlib.suppress(GatewayError):
                await self._adapters.unload(name)
        log.info("fine-tuning job %s succeeded: %s", job.id, name)

    async def _keep_adapter(self, job: JobView) -> bytes | None:
        """The job's adapter files (a tar archive) from the file store, fetched there first
        from the site that trained it; None when that site cannot hand them over."""
        kept = await self._files.content(adapter_file_id(job), job.owner)
        if kept is not None:
            return kept
        site = self._registry.get(job.site or "")
        client = site.client if site is not None else None
        if not isinstance(client, FineTunedAdapterSource):
            return None
        try:
            archive = await client.fine_tuned_adapter(job.id)
        except SiteRejected as exc:
            log.info("fine-tuning job %s: its site keeps the adapter: %s", job.id, exc)
            return None
        new = NewFile(adapter_file_id(job), job.owner, ADAPTER_FILE_PURPOSE,
                      f"{fine_tuned_model(job)}.tar", expires_at=None)  # fmt: skip
        with contextlib.suppress(IntegrityError):  # another gateway of the database kept it
            await self._files.create(new, archive, quota=None)
        return archive

    async def _spread(self, job: JobView, name: str, archive: bytes) -> None:
        """Sends the adapter to every healthy site of its base that does not serve it yet
        (those that refused it once are left alone until this gateway restarts)."""
        sites = [
            s for s in self._registry.all()
            if s.model == job.model and s.healthy and name not in s.adapters
            and (name, s.name) not in self._refused
        ]  # fmt: skip
        if not sites:
            return
        try:
            outcomes = await self._adapters.load_archive(_ownership(job, name), archive, sites)
        except GatewayError:
            if name in self._registry.served_adapters():
                return
            raise
        for outcome in outcomes:
            if not outcome.ok and outcome.reason != "unreachable":
                self._refused.add((name, outcome.site))
                log.warning("fine-tuned model %s not served on %s: %s", name, outcome.site,
                            outcome.error)  # fmt: skip

    async def _load(self, job: JobView, name: str, path: str) -> None:
        owner = _ownership(job, name)
        if name in self._registry.served_adapters():
            await self._declare(owner)  # loaded before this gateway restarted
            return
        body = LoadAdapterBody(name, path, job.model, site=job.site, owner_key=job.owner_key_name)
        try:
            await self._adapters.load(body, owner)
        except GatewayError as exc:
            if exc.code != "adapter_exists":
                raise
            await self._declare(owner)  # another gateway of the database loaded it first

    async def declare_trained(self) -> list[JobView]:
        """Declares every succeeded job's model with its owner (the gateway's start awaits it:
        no request is served before), and returns those jobs."""
        jobs = await self._store.served()
        for job in jobs:
            await self._declare(_ownership(job, job.fine_tuned_model or ""))
        return jobs

    async def _declare(self, owner: Ownership) -> None:
        if self._catalogue.stored(owner.name) != owner:
            await self._catalogue.declare(owner)

    async def _serve_succeeded(self) -> None:
        """Declares the succeeded jobs' models (those another gateway trained, too) and serves
        each on every healthy site of its base from the file store (a site started or back
        since gets it; the trainer site may be gone), or, for an adapter its site could not
        hand over, from that site's path when no healthy site serves it."""
        for job in await self.declare_trained():
            name = job.fine_tuned_model or ""
            try:
                await self._serve_again(job, name)
            except SiteCallError as exc:
                log.info("fine-tuned model %s: %s; trying again later", name, exc)
            except GatewayError as exc:
                self._unservable.add(name)  # said once; a restarted gateway tries again
                log.warning("fine-tuned model %s not served again: %s", name, exc.message)

    async def _serve_again(self, job: JobView, name: str) -> None:
        if name in self._unservable:
            return
        lacking = any(
            s.model == job.model and s.healthy and name not in s.adapters
            and (name, s.name) not in self._refused
            for s in self._registry.all()
        )  # fmt: skip
        if not lacking:
            return
        archive = await self._files.content(adapter_file_id(job), job.owner)
        if archive is not None:
            await self._spread(job, name, archive)
            return
        site = self._registry.get(job.site or "")
        if name in self._registry.served_adapters() or site is None or not site.healthy:
            return
        await self._load(job, name, job.adapter_path or "")
