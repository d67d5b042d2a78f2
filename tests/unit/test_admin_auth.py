"""The operator credential check: bearer token or session cookie, nothing else; the metrics
credential's settings."""

from __future__ import annotations

import pytest

from gateway.api.admin_auth import (
    DEVICE_TTL_S,
    bearer_is_admin,
    cookie_device,
    cookie_session,
    device_cookie,
    same_origin,
    session_cookie,
)
from gateway.settings import GatewaySettings, SettingsError

TOKEN = "s3cret-admin-token-123"
NOW = 1_800_000_000
TTL_S = 3600.0


@pytest.mark.parametrize(
    ("configured", "authorization", "expected"),
    [
        (TOKEN, f"Bearer {TOKEN}", True),
        (TOKEN, f"bearer {TOKEN}", True),
        (TOKEN, f"Bearer {TOKEN}x", False),
        (TOKEN, f"Basic {TOKEN}", False),
        (TOKEN, TOKEN, False),
        (TOKEN, None, False),
        (None, f"Bearer {TOKEN}", False),  # unset: nobody is an operator
        ("", "Bearer ", False),
    ],
)
def test_bearer_is_admin(configured: str | None, authorization: str | None, expected: bool) -> None:
    assert bearer_is_admin(configured, authorization) is expected


def test_a_session_cookie_names_its_session_until_it_expires() -> None:
    cookie = session_cookie(TOKEN, "abc", NOW)
    assert TOKEN not in cookie
    assert cookie_session(TOKEN, cookie, NOW + 5, TTL_S) == "abc"
    assert cookie_session(TOKEN, cookie, NOW + TTL_S - 1, TTL_S) == "abc"
    assert cookie_session(TOKEN, cookie, NOW + TTL_S, TTL_S) is None  # the server's expiry
    assert cookie_session(TOKEN, cookie, NOW - 60, TTL_S) is None  # issued in the future


@pytest.mark.parametrize(
    "cookie",
    [
        session_cookie("another-token-value", "abc", NOW),  # rotating the token voids it
        session_cookie(TOKEN, "abc", NOW).replace("abc", "abd"),  # another session's id
        session_cookie(TOKEN, "abc", NOW).replace(str(NOW), str(NOW + 3600)),  # extended
        TOKEN,
        "",
        None,
        "a.b.c",
    ],
)
def test_a_forged_or_altered_cookie_names_nothing(cookie: str | None) -> None:
    assert cookie_session(TOKEN, cookie, NOW + 5, TTL_S) is None


def test_short_admin_token_is_refused_loudly() -> None:
    with pytest.raises(SettingsError, match="GATEWAY_ADMIN_TOKEN"):
        GatewaySettings.from_env({"GATEWAY_FEDERATION_FILE": "f.json", "GATEWAY_ADMIN_TOKEN": "x"})


@pytest.mark.parametrize(
    ("metrics_token", "says"),
    [("short", "must be at least 16"), (TOKEN, "must differ from GATEWAY_ADMIN_TOKEN")],
)
def test_a_bad_metrics_token_is_refused_loudly(metrics_token: str, says: str) -> None:
    env = {"GATEWAY_FEDERATION_FILE": "f.json", "GATEWAY_ADMIN_TOKEN": TOKEN}
    with pytest.raises(SettingsError, match=f"GATEWAY_ADMIN_METRICS_TOKEN {says}"):
        GatewaySettings.from_env({**env, "GATEWAY_ADMIN_METRICS_TOKEN": metrics_token})
    settings = GatewaySettings.from_env({**env, "GATEWAY_ADMIN_METRICS_TOKEN": "m" * 16})
    assert settings.admin.metrics_token == "m" * 16


def test_a_device_cookie_is_signed_and_no_session_cookie() -> None:
    device = device_cookie(TOKEN, NOW)
    name = cookie_device(TOKEN, device, NOW + 5)
    assert name is not None
    assert len(name) == 32
    assert device_cookie(TOKEN, NOW) != device  # a new device id each time
    assert cookie_device(TOKEN, device, NOW + DEVICE_TTL_S) is None
    assert cookie_device("another-token-value", device, NOW + 5) is None
    # A session cookie is not a device cookie, nor the reverse (their signatures differ).
    assert cookie_device(TOKEN, session_cookie(TOKEN, "abc", NOW), NOW + 5) is None
    assert cookie_session(TOKEN, device, NOW + 5, TTL_S) is None


@pytest.mark.parametrize(
    ("origin", "host", "expected"),
    [
        ("http://127.0.0.1:8000", "127.0.0.1:8000", True),
        ("https://gw.example.com", "gw.example.com", True),  # TLS ended at the load balancer
        ("https://gw.example.com", "gw.example.com:443", True),
        ("http://gw.example.com:80", "gw.example.com", True),
        ("HTTPS://GW.example.com", "gw.EXAMPLE.com", True),
        ("http://127.0.0.1:8001", "127.0.0.1:8000", False),
        ("https://attacker.example", "gw.example.com", False),
        ("https://gw.example.com.attacker.example", "gw.example.com", False),
        ("null", "gw.example.com", False),
        ("file://", "gw.example.com", False),
        ("https://gw.example.com", None, False),
    ],
)
def test_same_origin(origin: str, host: str | None, expected: bool) -> None:
    assert same_origin(origin, host) is expected
