"""The batch API's settings: read from GATEWAY_BATCH_* variables, refused loudly when invalid."""

from __future__ import annotations

import pytest

from gateway.settings import GatewaySettings, SettingsError

BASE = {"GATEWAY_FEDERATION_FILE": "federation.json"}


def test_defaults_and_overrides() -> None:
    defaults = GatewaySettings.from_env(BASE)
    assert (defaults.batch_max_items, defaults.batch_site_concurrency) == (100_000, 16)
    assert (defaults.batch_max_attempts, defaults.batch_lease_s) == (3, 30.0)
    assert defaults.batch_max_body_bytes == 64 << 20
    settings = GatewaySettings.from_env(
        {
            **BASE,
            "GATEWAY_BATCH_MAX_ITEMS": "10",
            "GATEWAY_BATCH_MAX_BODY_BYTES": "2048",
            "GATEWAY_BATCH_SITE_CONCURRENCY": "2",
            "GATEWAY_BATCH_MAX_ATTEMPTS": "1",
            "GATEWAY_BATCH_LEASE_S": "2.5",
        }
    )
    assert (settings.batch_max_items, settings.batch_max_body_bytes) == (10, 2048)
    assert (settings.batch_site_concurrency, settings.batch_max_attempts) == (2, 1)
    assert settings.batch_lease_s == 2.5


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("BATCH_MAX_ITEMS", "0", "GATEWAY_BATCH_MAX_ITEMS must be >= 1"),
        ("BATCH_SITE_CONCURRENCY", "0", "GATEWAY_BATCH_SITE_CONCURRENCY must be >= 1"),
        ("BATCH_MAX_ATTEMPTS", "-1", "GATEWAY_BATCH_MAX_ATTEMPTS must be >= 1"),
        ("BATCH_MAX_BODY_BYTES", "100", "GATEWAY_BATCH_MAX_BODY_BYTES >= 1024"),
        ("BATCH_LEASE_S", "0", "GATEWAY_BATCH_LEASE_S > 0"),
        ("BATCH_MAX_ITEMS", "many", "GATEWAY_BATCH_MAX_ITEMS must be an integer"),
    ],
)
def test_invalid_values_name_the_variable(name: str, value: str, message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        GatewaySettings.from_env({**BASE, f"GATEWAY_{name}": value})
