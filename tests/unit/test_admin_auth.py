"""The operator credential check: bearer token or session cookie, nothing else."""

from __future__ import annotations

import pytest

from gateway.api.admin_auth import is_admin, session_value
from gateway.settings import GatewaySettings, SettingsError

TOKEN = "s3cret-admin-token-123"


@pytest.mark.parametrize(
    ("configured", "authorization", "cookie", "expected"),
    [
        (TOKEN, f"Bearer {TOKEN}", None, True),
        (TOKEN, f"bearer {TOKEN}", None, True),
        (TOKEN, f"Bearer {TOKEN}x", None, False),
        (TOKEN, f"Basic {TOKEN}", None, False),
        (TOKEN, TOKEN, None, False),
        (TOKEN, None, session_value(TOKEN), True),
        (TOKEN, None, TOKEN, False),  # the raw token is not a session
        (TOKEN, None, session_value("another-token-value"), False),
        (TOKEN, None, None, False),
        (None, f"Bearer {TOKEN}", session_value(TOKEN), False),  # unset: nobody is an operator
        ("", "Bearer ", None, False),
    ],
)
def test_is_admin(
    configured: str | None, authorization: str | None, cookie: str | None, expected: bool
) -> None:
    assert is_admin(configured, authorization, cookie) is expected


def test_short_admin_token_is_refused_loudly() -> None:
    with pytest.raises(SettingsError, match="GATEWAY_ADMIN_TOKEN"):
        GatewaySettings.from_env({"GATEWAY_FEDERATION_FILE": "f.json", "GATEWAY_ADMIN_TOKEN": "x"})
