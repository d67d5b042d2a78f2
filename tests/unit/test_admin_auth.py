"""The operator credential check: bearer token or session cookie, nothing else."""

from __future__ import annotations

import pytest

from gateway.api.admin_auth import (
    bearer_is_admin,
    cookie_session,
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
