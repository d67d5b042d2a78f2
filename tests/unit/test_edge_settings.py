"""The settings of issue 48's bounds at the gateway's edge: trusted proxies, header size."""

from __future__ import annotations

import pytest

from gateway.settings import GatewaySettings, SettingsError


def _settings(**env: str) -> GatewaySettings:
    return GatewaySettings.from_env({"GATEWAY_FEDERATION_FILE": "f.json", **env})


def test_no_proxy_is_trusted_by_default() -> None:
    assert _settings().access.proxy_networks() == ()


def test_trusted_proxies_are_addresses_and_networks() -> None:
    access = _settings(GATEWAY_TRUSTED_PROXIES=" 10.0.0.7, 10.1.2.3/16 ,fd00::/8,").access
    assert access.proxy_networks() == ("10.0.0.7/32", "10.1.0.0/16", "fd00::/8")


@pytest.mark.parametrize("entry", ["*", "proxy.example", "10.0.0.0/33"])
def test_a_trusted_proxy_that_is_no_address_is_refused(entry: str) -> None:
    with pytest.raises(SettingsError, match="GATEWAY_TRUSTED_PROXIES"):
        _settings(GATEWAY_TRUSTED_PROXIES=f"10.0.0.1,{entry}")


def test_header_bytes_default_and_floor() -> None:
    assert _settings().limits.max_header_bytes == 64 << 10
    assert _settings(GATEWAY_MAX_HEADER_BYTES="8192").limits.max_header_bytes == 8192
    with pytest.raises(SettingsError, match="GATEWAY_MAX_HEADER_BYTES must be >= 4096"):
        _settings(GATEWAY_MAX_HEADER_BYTES="1000")
