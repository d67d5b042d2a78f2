"""The batch, file and response APIs' settings: read from GATEWAY_BATCH_*, GATEWAY_FILE_* and
GATEWAY_RESPONSE_* variables, refused loudly when invalid."""

from __future__ import annotations

import pytest

from gateway.settings import GatewaySettings, SettingsError

BASE = {"GATEWAY_FEDERATION_FILE": "federation.json"}


def test_defaults_and_overrides() -> None:
    defaults = GatewaySettings.from_env(BASE)
    assert (defaults.batches.max_items, defaults.batches.site_concurrency) == (100_000, 16)
    assert (defaults.batches.max_attempts, defaults.batches.lease_s) == (3, 30.0)
    assert defaults.batches.max_body_bytes == 64 << 20
    assert (defaults.files.max_bytes, defaults.files.storage_per_key_bytes) == (64 << 20, 1 << 30)
    assert (defaults.files.retention_h, defaults.batches.uploads_in_flight) == (720.0, 4)
    assert defaults.responses.retention_h == 720.0
    settings = GatewaySettings.from_env(
        {
            **BASE,
            "GATEWAY_BATCH_MAX_ITEMS": "10",
            "GATEWAY_BATCH_MAX_BODY_BYTES": "2048",
            "GATEWAY_BATCH_SITE_CONCURRENCY": "2",
            "GATEWAY_BATCH_MAX_ATTEMPTS": "1",
            "GATEWAY_BATCH_LEASE_S": "2.5",
            "GATEWAY_FILE_MAX_BYTES": "4096",
            "GATEWAY_FILE_STORAGE_PER_KEY_BYTES": "8192",
            "GATEWAY_FILE_RETENTION_H": "1.5",
            "GATEWAY_BATCH_UPLOADS_IN_FLIGHT": "1",
            "GATEWAY_RESPONSE_RETENTION_H": "2",
        }
    )
    assert (settings.batches.max_items, settings.batches.max_body_bytes) == (10, 2048)
    assert (settings.batches.site_concurrency, settings.batches.max_attempts) == (2, 1)
    assert settings.batches.lease_s == 2.5
    assert (settings.files.max_bytes, settings.files.storage_per_key_bytes) == (4096, 8192)
    assert (settings.files.retention_h, settings.batches.uploads_in_flight) == (1.5, 1)
    assert settings.responses.retention_h == 2.0


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("BATCH_MAX_ITEMS", "0", "GATEWAY_BATCH_MAX_ITEMS must be >= 1"),
        ("BATCH_SITE_CONCURRENCY", "0", "GATEWAY_BATCH_SITE_CONCURRENCY must be >= 1"),
        ("BATCH_MAX_ATTEMPTS", "-1", "GATEWAY_BATCH_MAX_ATTEMPTS must be >= 1"),
        ("BATCH_MAX_BODY_BYTES", "100", "GATEWAY_BATCH_MAX_BODY_BYTES >= 1024"),
        ("BATCH_LEASE_S", "0", "GATEWAY_BATCH_LEASE_S > 0"),
        ("BATCH_MAX_ITEMS", "many", "GATEWAY_BATCH_MAX_ITEMS must be an integer"),
        ("FILE_MAX_BYTES", "100", "GATEWAY_FILE_MAX_BYTES must be >= 1024"),
        (
            "FILE_STORAGE_PER_KEY_BYTES",
            "2048",
            "GATEWAY_FILE_STORAGE_PER_KEY_BYTES must be >= GATEWAY_FILE",
        ),
        ("FILE_RETENTION_H", "0", "GATEWAY_FILE_RETENTION_H must be > 0"),
        ("BATCH_UPLOADS_IN_FLIGHT", "0", "GATEWAY_BATCH_UPLOADS_IN_FLIGHT must be >= 1"),
        ("RESPONSE_RETENTION_H", "0", "GATEWAY_RESPONSE_RETENTION_H must be > 0"),
    ],
)
def test_invalid_values_name_the_variable(name: str, value: str, message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        GatewaySettings.from_env({**BASE, f"GATEWAY_{name}": value})
