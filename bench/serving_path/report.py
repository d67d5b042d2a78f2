"""The serving-path benchmark's Markdown: the figures, issue 74's goals, and what refused or cut
requests (with the setting or limit their message names)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from bench.common import markdown_table
from bench.serving_path.figures import message_kind

# Issue 74's goals.
CPU_US_GOAL = 10.0
RATIO_GOALS = {"160": 0.9, "256": 0.8}
TTFT_P99_GOAL = {"160": 1.0}


def _num(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def _range(ranges: Mapping[str, Mapping[str, Any]], key: str, digits: int = 1) -> list[str]:
    r = ranges.get(key) or {}
    return [
        _num(r.get("median"), digits),
        f"{_num(r.get('min'), digits)}-{_num(r.get('max'), digits)}",
    ]


_CPU_ROWS = (
    ("site CPU µs per delivered token", "site_cpu_us_per_token", 1),
    ("gateway CPU µs per delivered token", "gateway_cpu_us_per_token", 1),
    ("clients' CPU µs per delivered token (not a goal)", "clients_cpu_us_per_token", 1),
    ("site's engine thread, µs per token (synthetic steps + the service's hand-off)",
     "site_engine_thread_cpu_us_per_token", 2),
    ("delivered tokens/s", "delivered_tokens_per_s", 0),
    ("engine generated tokens/s", "engine_generated_tokens_per_s", 0),
    ("path_vs_engine_tokens (delivered / the engine's capacity)", "path_vs_engine_tokens", 4),
    ("TTFT p50 s", "ttft_p50_s", 2),
    ("TTFT p99 s", "ttft_p99_s", 2),
    ("TPOT p50 s", "tpot_p50_s", 4),
    ("tokens per SSE chunk", "tokens_per_chunk", 3),
    ("site event loop busy (main thread CPU / wall)", "site_loop_busy", 2),
    ("gateway event loop busy", "gateway_loop_busy", 2),
    ("site cores", "site_cores", 2),
    ("gateway cores", "gateway_cores", 2),
    ("clients cores", "clients_cores", 2),
)  # fmt: skip


def _goal(value: float | None, goal: float, below: bool = True) -> str:
    if value is None:
        return "not measured"
    met = value <= goal if below else value >= goal
    return f"{value:,.2f} ({'met' if met else 'not met'})"


def _refusal_lines(reasons: Mapping[str, int]) -> list[str]:
    if not reasons:
        return ["None."]
    kinds: Counter[str] = Counter()
    for reason, count in reasons.items():
        kinds[message_kind(reason)] += count
    return [f"- {count} x `{reason}`" for reason, count in kinds.most_common()]


def _log_lines(logs: Mapping[str, Mapping[str, int]]) -> list[str]:
    lines = []
    for process, kinds in logs.items():
        for kind, count in kinds.items():
            lines.append(f"- {process}, {count} x `{kind}`")
    return lines or ["None."]


def _limits_table(env: Mapping[str, str]) -> str:
    """The bounds a thousand streams meet, as this run had them (the gateway's defaults unless
    the run set them)."""
    from gateway.settings import LimitsSettings, RoutingSettings, SitesSettings
    from site_engine.settings import SiteSettings

    sites = SitesSettings()
    site_queue = SiteSettings.__dataclass_fields__["max_queued_requests"].default
    rows = [
        ("GATEWAY_MAX_IN_FLIGHT", LimitsSettings().max_in_flight,
         "client requests one gateway holds; beyond: 429 `gateway_overloaded`"),
        ("GATEWAY_SITE_MAX_QUEUED_REQUESTS", RoutingSettings().site_max_queued_requests,
         "a site whose queue (its report, or the gateway's in-flight beyond its batch slots) "
         "reaches this gets nothing new; no site left: 503 `no site can serve` (queue_bound)"),
        ("GATEWAY_CONNECT_TIMEOUT_S", sites.connect_timeout_s,
         "a health check's deadline; GATEWAY_HEALTH_FAILURES_TO_DOWN "
         f"({sites.health_failures_to_down}) missed in a row mark the site unhealthy: 503 "
         "`no site can serve` (healthy: 0)"),
        ("site --max-queued-requests", site_queue,
         "requests waiting at the site; beyond: RESOURCE_EXHAUSTED, the gateway tries another"),
    ]  # fmt: skip
    return markdown_table(
        ("setting", "this run", "what it bounds"),
        [(name, env.get(name, default), text) for name, default, text in rows],
    )


def pooled(windows: list[dict[str, Any]], role: str) -> float | None:
    """A role's CPU µs per token over every window together (CPU seconds over tokens): steadier
    than a window's, whose tokens may have been made, or relayed, in the window before."""
    tokens = sum(w["delivered_tokens"] for w in windows)
    spent = sum((w.get(f"{role}_cpu_us_per_token") or 0.0) * w["delivered_tokens"] for w in windows)
    return spent / tokens if tokens else None


def cpu_markdown(payload: Mapping[str, Any]) -> str:
    setup, ranges, requests = payload["setup"], payload["ranges"], payload["requests"]
    env = setup["gateway_env"]
    parts = [
        "## Serving path, CPU mode\n",
        f"A real site process whose engine is synthetic ({setup['rows']:,} rows every "
        f"{setup['step_ms']:g} ms: {payload['engine_capacity_tokens_per_s']:,.0f} tokens/s at "
        f"most), the real gateway (SQLite, default routing), {setup['streams']:,} closed-loop "
        f"streams of {setup['max_tokens']} tokens from {setup['clients']} client processes "
        f"(started over {setup['ramp_s']:g} s). {setup['reps']} windows of {setup['seconds']:g} s "
        f"after {setup['warmup_s']:g} s of warm-up: median and min-max of the windows. CPU time "
        "is each process's user + system time (psutil), every thread; a token is one the "
        "clients received (each answer's usage, spread over its SSE events).\n",
        "Gateway settings: the defaults"
        + (", except " + ", ".join(f"`{k}={v}`" for k, v in env.items()) if env else "")
        + ".\n",
        markdown_table(("figure", "median", "min-max"),
                       [(label, *_range(ranges, key, digits)) for label, key, digits in _CPU_ROWS]),
        f"\nOver the {len(payload['windows'])} windows together: "
        + ", ".join(f"{role} {_num(pooled(payload['windows'], role))}"
                    for role in ("site", "gateway", "clients"))
        + " CPU µs per delivered token.",
        "\n### Limits in the way\n",
        _limits_table(env),
        "\nThe harness raises the gateway's health deadline to 30 s by default: at the 2 s default "
        "the site's health checks went unanswered three times in a row within the first minute "
        "at 1,024 streams on the 2-core machine, the gateway marked it unhealthy and refused "
        "nearly every request with 503 `no site can serve` (healthy: 0) while the site had free "
        "rows (serving_path_cpu_before_defaults). The clients wait 1 s after an answer that did "
        "not complete before their next request.",
        "\n### Issue 74's goals\n",
        f"- `site_cpu_us_per_token` <= {CPU_US_GOAL:g}: "
        + _goal(payload.get("site_cpu_us_per_token"), CPU_US_GOAL),
        f"- `gateway_cpu_us_per_token` <= {CPU_US_GOAL:g}: "
        + _goal(payload.get("gateway_cpu_us_per_token"), CPU_US_GOAL),
        "\n### Requests over the whole run (warm-up and drain included)\n",
        f"Sent {requests['sent']:,}, finished {requests['finished']:,}, refused "
        f"{requests['refused']:,}, cut {requests['cut']:,}, still open when the clients "
        f"stopped {requests['open_at_the_end']:,}. Refused or cut, by message:\n",
        *_refusal_lines(payload.get("refusals") or {}),
        "\nWarnings and errors in the servers' logs:\n",
        *_log_lines(payload.get("logs") or {}),
        "\n### Windows\n",
        _windows_table(payload["windows"]),
    ]  # fmt: skip
    return "\n".join(parts)


def _windows_table(windows: list[dict[str, Any]]) -> str:
    header = ("window", "delivered tok/s", "site µs/tok", "gateway µs/tok", "clients µs/tok",
              "finished", "refused", "cut", "TTFT p50 s", "site threads (cores)",
              "gateway threads (cores)")  # fmt: skip
    rows = [
        (i + 1, _num(w["delivered_tokens_per_s"], 0), _num(w.get("site_cpu_us_per_token")),
         _num(w.get("gateway_cpu_us_per_token")), _num(w.get("clients_cpu_us_per_token")),
         w["finished"], w["refused"], w["cut"], _num(w["ttft_p50_s"], 2),
         w.get("site_threads_cores"), w.get("gateway_threads_cores"))
        for i, w in enumerate(windows)
    ]  # fmt: skip
    return markdown_table(header, rows)


def gpu_markdown(payload: Mapping[str, Any]) -> str:
    setup, path, engine = payload["setup"], payload.get("path", {}), payload.get("engine", {})
    preset = setup["preset"]
    site = preset["sites"][0]
    rates = list(path)
    parts = [
        f"## Serving path, GPU mode ({payload.get('card', 'card not known yet')})\n",
        f"The path: one site (`{site['shape']}`, max_num_seqs {site['max_num_seqs']:,}, "
        f"{site['max_num_batched_tokens']:,}-token steps) behind a {site['one_way_ms']:g} ms "
        "one-way delay and the gateway, open-loop Poisson arrivals of streaming "
        f"/v1/completions from {setup['clients']} client processes, {preset['duration_s']:g} s "
        f"of arrivals a rate, {preset['drain_s']:g} s of drain. The engine: the same requests "
        "at the same times, in process, on the same card.\n",
        markdown_table(
            ("rate req/s", "path tok/s", "engine tok/s", "path_vs_engine_tokens",
             "TTFT p50/p99 s, path", "TTFT p50/p99 s, engine", "TPOT p50 ms, path",
             "TPOT p50 ms, engine", "finished, path", "refused", "cut"),
            [_gpu_row(r, path[r], engine.get(r)) for r in rates],
        ),
        "\n### CPU per delivered token and cores, path\n",
        markdown_table(
            ("rate req/s", "site µs", "gateway µs", "clients µs", "delay proxy µs",
             "site cores", "gateway cores", "tokens per SSE chunk"),
            [_cpu_row(r, path[r]) for r in rates],
        ),
        "\n### Issue 74's goals\n",
        *_gpu_goals(payload),
        "\n### Refused or cut, by message\n",
    ]  # fmt: skip
    for rate in rates:
        parts.append(f"{rate} req/s:")
        parts += _refusal_lines(path[rate].get("refusals") or {})
    parts += [
        "\nWarnings and errors in the servers' logs:\n",
        *_log_lines(payload.get("logs") or {}),
    ]
    if not payload.get("complete"):
        parts.append("\n**Incomplete**: the run ended before the in-process engine's phase.")
    return "\n".join(parts)


def _pair(row: Mapping[str, Any] | None, a: str, b: str) -> str:
    if row is None:
        return "-"
    return f"{_num(row.get(a), 3)} / {_num(row.get(b), 3)}"


def _ms(row: Mapping[str, Any] | None, key: str) -> str:
    value = None if row is None else row.get(key)
    return _num(value * 1000 if value is not None else None, 1)


def _gpu_row(
    rate: str, path: Mapping[str, Any], engine: Mapping[str, Any] | None
) -> tuple[Any, ...]:
    ratio = None
    if engine and engine.get("output_tokens_per_s"):
        ratio = path["output_tokens_per_s"] / engine["output_tokens_per_s"]
    return (
        rate,
        _num(path["output_tokens_per_s"], 0),
        _num(engine["output_tokens_per_s"], 0) if engine else "-",
        _num(ratio, 3),
        _pair(path, "ttft_p50_s", "ttft_p99_s"),
        _pair(engine, "ttft_p50_s", "ttft_p99_s"),
        _ms(path, "tpot_p50_s"),
        _ms(engine, "tpot_p50_s"),
        f"{path['completed']:,} of {path['requests']:,}",
        path["refused"],
        path["cut"],
    )


def _cpu_row(rate: str, path: Mapping[str, Any]) -> tuple[Any, ...]:
    us, cores = path["cpu_us_per_token"], path["cores"]
    return (rate, _num(us.get("site")), _num(us.get("gateway")), _num(us.get("clients")),
            _num(us.get("delay_proxy")), _num(cores.get("site"), 2),
            _num(cores.get("gateway"), 2), _num(path.get("tokens_per_chunk"), 3))  # fmt: skip


def _gpu_goals(payload: Mapping[str, Any]) -> list[str]:
    ratios, ttft = payload.get("path_vs_engine_tokens") or {}, payload.get("ttft_p99_s") or {}
    refused, cut = payload.get("refused") or {}, payload.get("cut") or {}
    lines = [
        f"- `path_vs_engine_tokens` at {rate} >= {goal:g}: "
        + _goal(ratios.get(rate), goal, below=False)
        for rate, goal in RATIO_GOALS.items()
    ]
    lines += [f"- `ttft_p99_s` at {rate} <= {goal:g} s: {_goal(ttft.get(rate), goal)}"
              for rate, goal in TTFT_P99_GOAL.items()]  # fmt: skip
    if "160" in refused:
        none = refused["160"] == 0 and cut["160"] == 0
        lines.append(f"- nothing refused or cut at 160: {refused['160']} refused, {cut['160']} "
                     f"cut ({'met' if none else 'not met'})")  # fmt: skip
    return lines
