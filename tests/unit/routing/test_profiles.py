"""Routing profiles from configuration: the built-in ones keep their names, a profile sums its
scorers' values with their weights, parts are checked when built, observers learn each decision,
and the federation file and GATEWAY_ROUTING_POLICY can name a profile of the operator's."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from gateway.federation import FederationConfigError, parse_federation
from gateway.routing.catalogue import BUILT_IN, SCORERS, build_profile
from gateway.routing.pickers import MaxScorePicker
from gateway.routing.policy import build_policy
from gateway.routing.profile import RoutingProfile, WeightedScorer
from gateway.routing.profile_settings import PartSettings, ProfileSettings
from gateway.routing.types import RoutableSite, RoutingRequest, Scored
from gateway.settings import GatewaySettings, SettingsError
from tests.unit.routing.sites import KnownPrefix, Site, request


@dataclass(frozen=True)
class Fixed:
    """A scorer that gives each site a fixed value."""

    name: str
    values: dict[str, float]

    def score(self, request: RoutingRequest, sites: Sequence[RoutableSite]) -> Scored:
        return Scored(tuple(self.values[site.name] for site in sites))


A, B = Site("a"), Site("b")


@pytest.mark.parametrize(
    ("weights", "chosen", "shortfall"),
    [
        # a: 1*1.0 + 1*0.0 = 1.0, b: 1*0.2 + 1*0.9 = 1.1
        ((1.0, 1.0), "b", {"a": 1.0, "b": 0.9}),
        # a: 3*1.0 + 1*0.0 = 3.0, b: 3*0.2 + 1*0.9 = 1.5
        ((3.0, 1.0), "a", {"a": 1.0, "b": 2.5}),
    ],
)
def test_a_profile_picks_the_highest_weighted_sum(weights, chosen, shortfall) -> None:
    load = Fixed("load", {"a": 1.0, "b": 0.2})
    cache = Fixed("cache", {"a": 0.0, "b": 0.9})
    profile = RoutingProfile(
        "p",
        (),
        (WeightedScorer(load, weights[0]), WeightedScorer(cache, weights[1])),
        MaxScorePicker(),
    )
    decision = profile.route(request(), [A, B])
    assert decision.site is not None
    assert decision.site.name == chosen
    assert decision.scores == pytest.approx(shortfall)
    assert decision.scorer_values == {"load": {"a": 1.0, "b": 0.2}, "cache": {"a": 0.0, "b": 0.9}}


def test_a_weight_must_be_positive() -> None:
    with pytest.raises(ValueError, match="weight must be > 0"):
        WeightedScorer(Fixed("x", {}), 0.0)


def test_every_built_in_profile_keeps_its_policy_name() -> None:
    for name in ("round_robin", "least_requests", "least_tokens", "least_tokens_guess", "mico",
                 "least_latency"):  # fmt: skip
        assert build_policy(name).name == name
    assert set(BUILT_IN) >= {"round_robin", "mico"}


def test_every_registered_scorer_answers_in_the_unit_range() -> None:
    sites = [
        Site("a", in_flight=2, outstanding_tokens=100, ledger_tokens=50, prefix=KnownPrefix(16)),
        Site("b", in_flight=7, outstanding_tokens=900, ledger_tokens=10, capacity_weight=3.0),
        Site("c", queued_tokens=500),
    ]
    req = request(50, 20, predicted=10, session="s")
    for name in SCORERS:
        profile = build_profile(ProfileSettings("p", (), (PartSettings(name),)))
        for observer in profile.observers:
            observer.routed(req, sites[1])
        values = profile.scorers[0].scorer.score(req, sites).values
        assert len(values) == 3, name
        assert all(0.0 <= v <= 1.0 for v in values), (name, values)
        assert max(values) == 1.0, name  # the best candidate scores 1


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (ProfileSettings("p", (PartSettings("nope"),)), "unknown filter 'nope'"),
        (ProfileSettings("p", (), (PartSettings("nope"),)), "unknown scorer 'nope'"),
        (ProfileSettings("p", (), (), PartSettings("nope")), "unknown picker 'nope'"),
        (
            ProfileSettings("p", (PartSettings.of("queue_bound", max_requests=0),)),
            "max_requests must be >= 1",
        ),
        (
            ProfileSettings("p", (PartSettings.of("queue_bound", size=3),)),
            r"unknown parameters \['size'\]",
        ),
        (
            ProfileSettings("p", (), (), PartSettings.of("max_score", ties="bucket")),
            "ties must be one of",
        ),
        (
            ProfileSettings("p", (), (PartSettings.of("least_tokens", normalize=3),)),
            "normalize must be one of",
        ),
    ],
)
def test_bad_parts_are_refused_naming_the_profile(settings, message) -> None:
    with pytest.raises(ValueError, match=f"routing profile 'p': .*{message}"):
        build_profile(settings)


def test_the_queue_bound_comes_from_the_settings_unless_the_profile_sets_it() -> None:
    busy = Site("busy", queued_requests=5)
    assert build_policy("least_requests", max_site_queue=5).route(request(), [busy]).site is None
    custom = ProfileSettings(
        "roomy", (PartSettings.of("queue_bound", max_requests=10),), (PartSettings("least_tokens"),)
    )
    policy = build_policy("roomy", max_site_queue=5, custom=[custom])
    assert policy.route(request(), [busy]).site == busy


PROFILE = {
    "name": "balanced",
    "filters": ["serves_model", "healthy", {"name": "queue_bound", "params": {"max_requests": 4}}],
    "scorers": [{"name": "least_tokens", "weight": 2}, "least_requests"],
    "picker": {"name": "max_score", "params": {"ties": "model_bucket"}},
}
FEDERATION = {
    "models": [{"name": "m", "tokenizer": "tok"}],
    "sites": [{"name": "a", "cloud": "c", "region": "r", "endpoint": "h:1", "model": "m"}],
}


def test_the_federation_file_defines_profiles(tmp_path: Path) -> None:
    config = parse_federation(
        json.dumps({**FEDERATION, "routing_profiles": [PROFILE]}).encode(), tmp_path
    )
    (profile,) = config.routing_profiles
    assert profile.filters[2] == PartSettings.of("queue_bound", max_requests=4)
    assert [(s.name, s.weight) for s in profile.scorers] == [
        ("least_tokens", 2.0),
        ("least_requests", 1.0),
    ]
    built = build_policy("balanced", custom=config.routing_profiles)
    queued = Site("a", queued_requests=4)
    assert built.route(request(), [queued, Site("b")]).site == Site("b")


@pytest.mark.parametrize(
    ("profile", "message"),
    [
        ({**PROFILE, "name": "mico"}, "must be new and unique"),
        ({**PROFILE, "scorers": ["fastest"]}, "unknown scorer 'fastest'"),
        ({**PROFILE, "scorers": [{"name": "least_tokens", "weight": 0}]}, "invalid federation"),
    ],
)
def test_bad_profiles_in_the_federation_file_are_refused(tmp_path: Path, profile, message) -> None:
    data = json.dumps({**FEDERATION, "routing_profiles": [profile]}).encode()
    with pytest.raises(FederationConfigError, match=message):
        parse_federation(data, tmp_path)


def test_the_routing_policy_setting_may_name_a_profile_of_the_federation_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "federation.json"
    path.write_text(json.dumps({**FEDERATION, "routing_profiles": [PROFILE]}))
    env = {"GATEWAY_FEDERATION_FILE": str(path)}
    settings = GatewaySettings.from_env({**env, "GATEWAY_ROUTING_POLICY": "balanced"})
    assert settings.routing.policy == "balanced"
    with pytest.raises(SettingsError, match=r"routing_profiles \['balanced'\].*'fastest'"):
        GatewaySettings.from_env({**env, "GATEWAY_ROUTING_POLICY": "fastest"})
