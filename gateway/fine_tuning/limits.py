"""A key's limits on training (issue 58: 30 jobs of one key were accepted and another key's
small job waited behind them; a key limited to 700 tokens a minute was given a job of ~100k
tokens x 50 epochs).

Three limits, all per key (the anonymous caller of an open gateway counts as one key):
unfinished jobs at once (GATEWAY_FINE_TUNING_JOBS_PER_KEY), jobs whose files are being checked
at once (GATEWAY_FINE_TUNING_VALIDATIONS_PER_KEY: issue 67, two 20 MiB files of one key held the
gateway's parsing for 150 s), and tokens trained in a rolling 24 hours
(GATEWAY_FINE_TUNING_TOKENS_PER_KEY_DAY), a budget of its own: training runs in the sites' idle
cycles, not in the minute windows inference is admitted in, but a key limited in tokens per
minute trains at most what it could spend in a day (1,440 of its minutes). A job counts its
estimate (its training file's bytes / 4 per epoch: the JSON around the text makes that an
over-estimate of the tokens the site trains) until it ends, then what its site reported
trained; failed and cancelled jobs count what they trained, and a job whose files were refused
counts one epoch's estimate: the gateway read them once, at the key's expense (issue 67: a
refused 20 MiB file cost its key nothing). The store checks all three in the transaction that
makes the job, its key's row locked, so that concurrent creates of one key, on two gateways of
one database too, cannot all pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from gateway.db.models import utcnow
from gateway.errors import GatewayError, RateLimited
from gateway.stores.fine_tuning_store import JobUse

WINDOW = timedelta(hours=24)
MINUTES_PER_WINDOW = 1440
# Bytes of chat JSONL per trained token, for a job's estimate (English BPE: ~4 characters of
# text a token; the JSON syntax around it is counted too, which over-estimates).
BYTES_PER_TOKEN = 4


def window_start() -> datetime:
    return utcnow() - WINDOW


def estimated_tokens(training_bytes: int, epochs: int) -> int:
    return -(-training_bytes // BYTES_PER_TOKEN) * epochs


def tokens_of(job: JobUse) -> int:
    """What one of the key's jobs counts: its estimate until it ends, then what it trained (a
    job whose files were refused: one reading of them)."""
    if job.refused_files:
        return estimated_tokens(job.training_bytes, 1)
    if job.final:
        return job.trained_tokens
    return max(job.trained_tokens, estimated_tokens(job.training_bytes, job.epochs))


@dataclass(frozen=True, slots=True)
class TrainingLimits:
    jobs_per_key: int
    tokens_per_day: int
    validations_per_key: int = 1

    def budget(self, tokens_per_minute: int | None) -> int:
        """The key's training tokens per window."""
        if tokens_per_minute is None:
            return self.tokens_per_day
        return min(self.tokens_per_day, tokens_per_minute * MINUTES_PER_WINDOW)

    def check(
        self,
        who: str,
        tokens_per_minute: int | None,
        jobs: Sequence[JobUse],
        wanted: int,
        checking: int = 0,
    ) -> None:
        """Raises 429 when a new job of `wanted` tokens would pass the key's limits, given its
        jobs made within the window and those still unfinished (`jobs`), and the checks of its
        jobs this gateway holds (`checking`: a cancelled job's until it has stopped)."""
        unfinished = sum(1 for job in jobs if not job.final)
        if unfinished >= self.jobs_per_key:
            raise RateLimited(
                f"{who} has {unfinished} fine-tuning jobs unfinished, its limit of "
                f"{self.jobs_per_key} (GATEWAY_FINE_TUNING_JOBS_PER_KEY): retry when one ends, "
                "or cancel one (POST /v1/fine_tuning/jobs/{id}/cancel)",
                limit="requests",
                code="fine_tuning_jobs_limit_exceeded",
            )
        validating = max(checking, sum(1 for job in jobs if job.validating))
        if validating >= self.validations_per_key:
            raise RateLimited(
                f"{who} has {validating} fine-tuning jobs whose files are being validated, its "
                f"limit of {self.validations_per_key} (GATEWAY_FINE_TUNING_VALIDATIONS_PER_KEY): "
                "retry when that ends",
                limit="requests",
                code="fine_tuning_validations_limit_exceeded",
            )
        budget = self.budget(tokens_per_minute)
        used = sum(tokens_of(job) for job in jobs)
        if wanted > budget:
            raise _tokens_refused(
                f"a job of about {wanted} training tokens (its file's bytes / "
                f"{BYTES_PER_TOKEN} x its epochs) is more than {who} may train in 24 hours, "
                f"{budget}: it can never fit; train on less data or fewer epochs"
            )
        if used + wanted > budget:
            raise _tokens_refused(
                f"training token limit reached for {who}: limit {budget} per 24 hours, used "
                f"{used}, requested about {wanted} (its file's bytes / {BYTES_PER_TOKEN} x its "
                "epochs); retry once earlier jobs leave the 24-hour window"
            )


def _tokens_refused(message: str) -> GatewayError:
    return RateLimited(message, limit="tokens", code="training_tokens_limit_exceeded")
