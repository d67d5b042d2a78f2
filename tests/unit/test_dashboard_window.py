"""The dashboard's history grid: the default bucket of each window the page offers is at least
two sampler intervals wide, so every bucket of a window holds a sample while the sampler runs
and the charts draw lines (with 4 s buckets and a sample every 10 s, most buckets were empty and
the 15-minute charts blank)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from gateway.admin.dashboard import Dashboard
from gateway.settings import GatewaySettings, HistorySettings
from gateway.sites.registry import SiteRegistry

WINDOWS = (900, 3600, 21600, 86400)  # the page's choices (gateway/admin_ui/pages/dashboard.html)


def dashboard(interval_s: float) -> Dashboard:
    settings = GatewaySettings(
        federation_file=Path("unused.json"),
        history=HistorySettings(load_sample_interval_s=interval_s),
    )
    return Dashboard(settings, SiteRegistry([]), None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("interval_s", "window_s", "step_s"),
    [
        (10.0, 900, 20),
        (10.0, 3600, 20),
        (10.0, 21600, 75),
        (10.0, 86400, 300),
        (0.5, 900, 4),
        (0.5, 60, 1),
        (30.0, 900, 60),
        (2.5, 3600, 13),
    ],
)
def test_default_step(interval_s: float, window_s: int, step_s: int) -> None:
    assert dashboard(interval_s).default_step(window_s) == step_s


@pytest.mark.parametrize("interval_s", [0.5, 2.0, 10.0, 30.0])
@pytest.mark.parametrize("window_s", WINDOWS)
def test_every_bucket_holds_a_sample(interval_s: float, window_s: int) -> None:
    """Samples as the sampler writes them (each interval plus a write of up to a tenth of it,
    on no grid) fall into every bucket of the window's grid between the first and the last."""
    step = dashboard(interval_s).default_step(window_s)
    rng = random.Random(window_s)
    at, end = rng.uniform(0, step), window_s
    filled: set[int] = set()
    while at < end:
        filled.add(int(at // step))
        at += interval_s + rng.uniform(0, interval_s / 10)
    assert filled == set(range(min(filled), max(filled) + 1))
