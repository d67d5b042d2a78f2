"""TLS and logging settings on both sides: all three files or none, readable PEM, loud errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.federation import FederationConfigError, parse_federation
from gateway.settings import GatewaySettings
from gateway.settings import SettingsError as GatewaySettingsError
from gateway.sites.tls import load_site_tls
from site_engine.settings import SettingsError as SiteSettingsError
from site_engine.settings import SiteSettings
from site_engine.tls import load_server_tls
from tests.support.tls_certs import TestPki, make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> TestPki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def site(env: dict[str, str]) -> SiteSettings:
    return SiteSettings.load({"SITE_MODEL_DIR": "m", **env})


def gateway(env: dict[str, str]) -> GatewaySettings:
    return GatewaySettings.from_env({"GATEWAY_FEDERATION_FILE": "f.json", **env})


def test_plaintext_is_the_default_on_both_sides() -> None:
    assert load_server_tls(site({})) is None
    assert load_site_tls(gateway({})) is None


def test_site_tls_loads_from_env(pki: TestPki) -> None:
    tls = load_server_tls(site(pki.site_env()))
    assert tls is not None
    assert tls.private_key == pki.server_key.read_bytes()
    assert tls.client_ca == pki.ca_cert.read_bytes()
    tls.credentials()  # gRPC accepts them
    assert b"PRIVATE" not in repr(tls).encode()


def test_gateway_tls_loads_from_env(pki: TestPki) -> None:
    tls = load_site_tls(gateway(pki.gateway_env()))
    assert tls is not None
    assert tls.certificate_chain == pki.client_cert.read_bytes()
    tls.channel_credentials()
    assert "PRIVATE" not in repr(tls)


@pytest.mark.parametrize("left_out", ["SITE_TLS_CERT", "SITE_TLS_KEY", "SITE_TLS_CLIENT_CA"])
def test_site_tls_needs_all_three(pki: TestPki, left_out: str) -> None:
    env = {k: v for k, v in pki.site_env().items() if k != left_out}
    with pytest.raises(SiteSettingsError, match=f"missing \\['{left_out}'\\]"):
        site(env)


@pytest.mark.parametrize(
    "left_out", ["GATEWAY_SITE_TLS_CA", "GATEWAY_SITE_TLS_CERT", "GATEWAY_SITE_TLS_KEY"]
)
def test_gateway_tls_needs_all_three(pki: TestPki, left_out: str) -> None:
    env = {k: v for k, v in pki.gateway_env().items() if k != left_out}
    with pytest.raises(GatewaySettingsError, match=f"missing \\['{left_out}'\\]"):
        gateway(env)


def test_unreadable_or_wrong_files_name_their_variable(pki: TestPki, tmp_path: Path) -> None:
    not_pem = tmp_path / "notes.txt"
    not_pem.write_text("hello")
    with pytest.raises(SiteSettingsError, match=r"SITE_TLS_KEY: .* not a PEM file"):
        load_server_tls(site({**pki.site_env(), "SITE_TLS_KEY": str(pki.server_cert)}))
    with pytest.raises(SiteSettingsError, match="SITE_TLS_CLIENT_CA: cannot read"):
        load_server_tls(site({**pki.site_env(), "SITE_TLS_CLIENT_CA": str(tmp_path / "no.pem")}))
    with pytest.raises(GatewaySettingsError, match=r"GATEWAY_SITE_TLS_CA: .* not a PEM file"):
        load_site_tls(gateway({**pki.gateway_env(), "GATEWAY_SITE_TLS_CA": str(not_pem)}))


def test_log_levels_are_checked() -> None:
    assert site({"SITE_LOG_LEVEL": "DEBUG"}).log_level == "DEBUG"
    assert gateway({"GATEWAY_LOG_LEVEL": "WARNING"}).server.log_level == "WARNING"
    with pytest.raises(SiteSettingsError, match="SITE_LOG_LEVEL"):
        site({"SITE_LOG_LEVEL": "loud"})
    with pytest.raises(GatewaySettingsError, match="GATEWAY_LOG_LEVEL"):
        gateway({"GATEWAY_LOG_LEVEL": "verbose"})


def _federation(**site_fields: object) -> bytes:
    site: dict[str, object] = {"name": "a", "cloud": "aws", "region": "r"}
    site["endpoint"] = "10.0.0.5:50051"
    site.update({"model": "m", **site_fields})
    return json.dumps({"models": [{"name": "m", "tokenizer": "t"}], "sites": [site]}).encode()


def test_federation_file_carries_a_tls_server_name() -> None:
    config = parse_federation(_federation(tls_server_name="site-a.fedllm.internal"), Path("."))
    assert config.sites[0].tls_server_name == "site-a.fedllm.internal"
    assert parse_federation(_federation(), Path(".")).sites[0].tls_server_name is None
    with pytest.raises(FederationConfigError, match="tls_server_name"):
        parse_federation(_federation(tls_server_name="not a host/name"), Path("."))
