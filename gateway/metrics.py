"""The gateway's Prometheus metrics: what it decided and how fast, and its live view of each site.

Each GatewayRuntime owns one GatewayMetrics with its own CollectorRegistry (never the process-
global default), so several gateways in one process (tests) keep separate counts. Events
(routing, failovers, offloads, predictions, finished requests, HTTP requests) are recorded as
they happen; the per-site load gauges are read from the SiteRegistry at scrape time by
SiteLoadCollector, so a scrape always shows the state right now and nothing has to push it.
Label values are bounded: sites and models come from the federation file (and the sites that
join at run time: an operator's, or the scaling controller's within its max_sites), policies,
statuses and finish reasons from fixed sets, HTTP routes from the app's path templates.
docs/metrics.md lists every metric.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from operator import attrgetter

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fedllm_contract.load_gauges import SHARED_LOAD_GAUGES
from gateway.sites.interface import LoadView
from gateway.sites.registry import SiteState

NO_SITE = "none"  # the site label of a request no site could take
# Seconds: from sub-millisecond (predictor, small HTTP answers) to long generations.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0, 120.0, 300.0)  # fmt: skip
# Tokens: |predicted - actual| answer length, powers of two up to a long answer.
TOKEN_ERROR_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
SITE_LABELS = ("site", "cloud", "region")


@dataclass(frozen=True, slots=True)
class _SiteGauge:
    name: str
    doc: str
    value: Callable[[SiteState], float]


@dataclass(frozen=True, slots=True)
class _ReportGauge:
    name: str
    doc: str
    value: Callable[[LoadView], float]


# From the gateway's own bookkeeping: present for every configured site.
_SITE_GAUGES = (
    _SiteGauge("healthy", "1 if the site receives new requests, else 0", lambda s: s.healthy),
    _SiteGauge(
        "outstanding_tokens",
        "Token load routing uses: the larger of the gateway's ledger and the site's report",
        lambda s: s.outstanding_tokens,
    ),
    _SiteGauge(
        "ledger_tokens",
        "Prompt + predicted remaining answer tokens of this gateway's requests at the site",
        lambda s: s.ledger_tokens,
    ),
    _SiteGauge(
        "in_flight_requests",
        "This gateway's requests at the site not finished yet",
        lambda s: s.in_flight,
    ),
    _SiteGauge(
        "prefix_index_blocks",
        "Prefix-cache block ids the gateway keeps for the site (bounded memory)",
        lambda s: s.prefix.blocks,
    ),
    _SiteGauge(
        "prefix_index_events",
        "1 if the site's prefix index follows its cache events, 0 if it is this gateway's history",
        lambda s: s.prefix.mode == "events",
    ),
    _SiteGauge(
        "prefix_index_stale",
        "1 while the site's event index waits for a snapshot (a batch was lost): no match",
        lambda s: s.prefix.stale,
    ),
)
# From the site's last pushed load report: absent until the site has reported.
_REPORT_GAUGES = (
    _ReportGauge("queued_requests", "Requests waiting at the site", lambda r: r.queued_requests),
    _ReportGauge(
        "running_requests", "Requests in the site's running batch", lambda r: r.running_requests
    ),
    *(_ReportGauge(name, doc, attrgetter(name)) for name, doc in SHARED_LOAD_GAUGES),
    _ReportGauge(
        "decode_tokens_per_second",
        "Decode throughput the site reports",
        lambda r: r.decode_tokens_per_s,
    ),
    _ReportGauge(
        "prefill_tokens_per_second",
        "Prompt tokens per second of prefilling the site reports (0: none lately)",
        lambda r: r.prefill_tokens_per_s,
    ),
)


class SiteLoadCollector(Collector):
    """Per-site load gauges, labelled site/cloud/region, read from the registry when scraped."""

    def __init__(self, sites: Callable[[], Iterable[SiteState]]) -> None:
        self._sites = sites

    def collect(self) -> Iterator[Metric]:
        sites = list(self._sites())
        for gauge in _SITE_GAUGES:
            family = GaugeMetricFamily(f"fedllm_gateway_site_{gauge.name}", gauge.doc,
                                       labels=SITE_LABELS)  # fmt: skip
            for site in sites:
                family.add_metric(_site_labels(site), float(gauge.value(site)))
            yield family
        for report_gauge in _REPORT_GAUGES:
            family = GaugeMetricFamily(
                f"fedllm_gateway_site_{report_gauge.name}",
                f"{report_gauge.doc} (the site's last load report)",
                labels=SITE_LABELS,
            )
            for site in sites:
                if site.report is not None:
                    family.add_metric(_site_labels(site), float(report_gauge.value(site.report)))
            yield family


class CallbackGauge(Collector):
    """One unlabelled gauge read from `value` when scraped (a backlog's size, say)."""

    def __init__(self, name: str, doc: str, value: Callable[[], float]) -> None:
        self._name, self._doc, self._value = name, doc, value

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(self._name, self._doc, value=float(self._value()))


class StateCountGauge(Collector):
    """One gauge labelled by `state`, read from a mapping of state to count when scraped."""

    def __init__(self, name: str, doc: str, counts: Callable[[], Mapping[str, int]]) -> None:
        self._name, self._doc, self._counts = name, doc, counts

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(self._name, self._doc, labels=["state"])
        for state, count in sorted(self._counts().items()):
            family.add_metric([state], float(count))
        yield family


@dataclass(frozen=True, slots=True)
class ModelCapacity:
    """One model's capacity as the scaling controller last saw and decided it."""

    model: str
    serving_sites: int
    pending_sites: int
    desired_sites: int
    backlog_s: float
    forecast_backlog_s: float
    arrival_rate: float = 0.0
    lead_s: float = 0.0
    level_s: float = 0.0
    pool_pods: int = 0  # the kubernetes actuator's warm pool: pods run beyond the desired sites


SCALING_GAUGES: tuple[tuple[str, str, Callable[[ModelCapacity], float]], ...] = (
    ("desired_sites", "Sites the scaling controller wants serving the model (the autoscaler's "
     "target without a pool)", lambda m: m.desired_sites),
    ("desired_pods", "Pods the model's StatefulSet should run: the desired sites plus the "
     "kubernetes actuator's warm pool (pool_size), what KEDA or the HPA scale it to "
     "(deploy/k8s)", lambda m: m.desired_sites + m.pool_pods),
    ("serving_sites", "The model's sites taking new work (healthy, not draining)",
     lambda m: m.serving_sites),
    ("pending_sites", "Sites asked for that do not serve yet (starting)",
     lambda m: m.pending_sites),
    ("backlog_seconds", "Predicted work queued and running at the model's serving sites, in "
     "seconds of one site's measured throughput, per serving site", lambda m: m.backlog_s),
    ("forecast_backlog_seconds", "The backlog per site the controller expects one lead time "
     "ahead (from the arrival rate), what scale-out is decided on",
     lambda m: m.forecast_backlog_s),
    ("arrival_rate", "Predicted work admitted per second, in seconds of one site's measured "
     "throughput (smoothed): the sites it needs busy", lambda m: m.arrival_rate),
    ("lead_seconds", "How far ahead the forecast looks: the actuator's last measured site "
     "start, else the rule's lead_time_s", lambda m: m.lead_s),
    ("smoothed_backlog_seconds", "The backlog per serving site, time-weighted over the "
     "rule's in_window_s since the last step: what scale-in is decided on",
     lambda m: m.level_s),
)  # fmt: skip


class ScalingCollector(Collector):
    """Per-model scaling gauges (fedllm_gateway_scaling_*), labelled by model."""

    def __init__(self, models: Callable[[], Iterable[ModelCapacity]]) -> None:
        self._models = models

    def collect(self) -> Iterator[Metric]:
        models = list(self._models())
        for name, doc, value in SCALING_GAUGES:
            family = GaugeMetricFamily(f"fedllm_gateway_scaling_{name}", doc, labels=("model",))
            for model in models:
                family.add_metric([model.model], float(value(model)))
            yield family


def _site_labels(site: SiteState) -> list[str]:
    return [site.name, site.config.cloud, site.config.region]


class GatewayMetrics:
    """Every gateway metric, in one registry of its own."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)  # process_* (CPU, memory, fds), as the default registry has
        self.routing_decisions = Counter(
            "fedllm_gateway_routing_decisions", "Requests placed by routing (site 'none': no "
            "site could take it)", ("policy", "site"), registry=r,
        )  # fmt: skip
        self.failovers = Counter(
            "fedllm_gateway_failovers", "Requests moved off a site that became unavailable "
            "before they started", ("site",), registry=r,
        )  # fmt: skip
        self.continuations = Counter(
            "fedllm_gateway_continuations", "Answers that went on on another site after this "
            "site failed mid-stream", ("site",), registry=r,
        )  # fmt: skip
        self.answers_out_of_time = Counter(
            "fedllm_gateway_answers_out_of_time", "Answers without a client's length limit "
            "ended at GATEWAY_OPEN_ANSWER_TIMEOUT_S (finish_reason length) on this site",
            ("site",), registry=r,
        )  # fmt: skip
        self.offloads = Counter(
            "fedllm_gateway_offloads", "Queued requests a giver site released that restarted "
            "on a taker site", ("giver", "taker"), registry=r,
        )  # fmt: skip
        self.offload_releases = Counter(
            "fedllm_gateway_offload_releases", "Queued requests released by offload "
            "negotiation, by giver and the planned taker", ("giver", "taker"), registry=r,
        )  # fmt: skip
        self.prediction_seconds = Histogram(
            "fedllm_gateway_prediction_seconds", "Length prediction latency per request, "
            "micro-batching wait included", registry=r, buckets=LATENCY_BUCKETS,
        )  # fmt: skip
        self.predictor_batch_seconds = Histogram(
            "fedllm_gateway_predictor_batch_seconds", "One predictor call over a micro-batch",
            registry=r, buckets=LATENCY_BUCKETS,
        )  # fmt: skip
        self.prediction_fallbacks = Counter(
            "fedllm_gateway_prediction_fallbacks", "Requests routed without a prediction "
            "(reason: no_predictor or error)", ("reason",), registry=r,
        )  # fmt: skip
        self.prediction_error_tokens = Histogram(
            "fedllm_gateway_prediction_error_tokens", "|predicted - actual| completion tokens "
            "of finished requests that had a prediction", ("model",), registry=r,
            buckets=TOKEN_ERROR_BUCKETS,
        )  # fmt: skip
        self.requests_finished = Counter(
            "fedllm_gateway_requests_finished", "Dispatched requests by the site that ended "
            "them and their status (completed, failed, cancelled)", ("site", "status"),
            registry=r,
        )  # fmt: skip
        self.completion_tokens = Counter(
            "fedllm_gateway_completion_tokens", "Completion tokens received from each site",
            ("site",), registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "fedllm_gateway_prompt_tokens", "Prompt tokens of requests each site ended",
            ("site",), registry=r,
        )  # fmt: skip
        self.ttft_seconds = Histogram(
            "fedllm_gateway_ttft_seconds", "Time to first token, from dispatch (prediction "
            "and routing included) to the first token from the site", ("site",), registry=r,
            buckets=LATENCY_BUCKETS,
        )  # fmt: skip
        self.http_requests = Counter(
            "fedllm_gateway_http_requests", "HTTP requests by route template, method and status",
            ("route", "method", "status"), registry=r,
        )  # fmt: skip
        self.site_changes = Counter(
            "fedllm_gateway_site_changes", "Sites that joined or left at run time (change: "
            "join, leave), by the admin API or the scaling controller", ("change",), registry=r,
        )  # fmt: skip
        self.scaling_decisions = Counter(
            "fedllm_gateway_scaling_decisions", "The scaling controller's decisions per model "
            "(action: scale_out, scale_in, start_failed)", ("model", "action"), registry=r,
        )  # fmt: skip
        self.http_seconds = Histogram(
            "fedllm_gateway_http_request_seconds", "HTTP request latency (a stream: until its "
            "last byte) by route template and method", ("route", "method"), registry=r,
            buckets=LATENCY_BUCKETS,
        )  # fmt: skip

    def watch_sites(self, sites: Callable[[], Iterable[SiteState]]) -> None:
        self.registry.register(SiteLoadCollector(sites))

    def watch_scaling(self, models: Callable[[], Iterable[ModelCapacity]]) -> None:
        """The scaling controller's view of each model (gateway/scaling/), read at each scrape:
        the signal KEDA or the HPA scales the sites on (deploy/k8s/)."""
        self.registry.register(ScalingCollector(models))

    def watch_backlog(self, name: str, doc: str, value: Callable[[], float]) -> None:
        """Exposes fedllm_gateway_<name>, read from `value` at each scrape."""
        self.registry.register(CallbackGauge(f"fedllm_gateway_{name}", doc, value))

    def watch_fine_tuning(self, counts: Callable[[], Mapping[str, int]]) -> None:
        """Exposes fedllm_gateway_fine_tuning_jobs{state}: the jobs in each state, every key's,
        as the fine-tuning runner's last pass counted them."""
        self.registry.register(StateCountGauge(
            "fedllm_gateway_fine_tuning_jobs", "Fine-tuning jobs by state", counts))  # fmt: skip

    def routed(self, policy: str, site: str | None) -> None:
        self.routing_decisions.labels(policy, site or NO_SITE).inc()

    def finished(
        self,
        site: str,
        model: str,
        status: str,
        tokens: tuple[int, int],
        predicted_tokens: int | None,
    ) -> None:
        """A dispatched request ended; `tokens` is (prompt, completion). The prediction error is
        recorded only for answers that ended on their own or at max_tokens."""
        prompt, completion = tokens
        self.requests_finished.labels(site, status).inc()
        self.prompt_tokens.labels(site).inc(prompt)
        self.completion_tokens.labels(site).inc(completion)
        if predicted_tokens is not None and status == "completed":
            self.prediction_error_tokens.labels(model).observe(abs(predicted_tokens - completion))

    def exposition(self) -> bytes:
        """The Prometheus text format of everything in this registry."""
        return generate_latest(self.registry)
