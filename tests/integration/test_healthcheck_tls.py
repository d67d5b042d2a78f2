"""The container health probe (`python -m site_engine.healthcheck`, the site image's HEALTHCHECK)
against a real site serving mutual TLS, with certificates shaped like the deployment's
(infra/terraform): one CA signs the gateway's client certificate and each engine's certificate,
which names the engine's federation name and public address and carries clientAuth as well as
serverAuth, so that the probe can present it to its own engine."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from devtools.launch import ManagedProcess, start_site
from site_engine.healthcheck import certificate_dns_names, load_probe_tls
from site_engine.settings import SiteSettings
from tests.support.tls_certs import TestPki, _issue, _write, make_pki

pytestmark = pytest.mark.slow
ENGINE = "aws-use1-1"  # the engine's federation name: the DNS name of its certificate
PUBLIC_IP = "203.0.113.9"  # its public address, which the probe (on 127.0.0.1) does not dial


@dataclass(frozen=True)
class DeploymentPki:
    directory: Path  # ca.crt, engine.crt/.key (server+client), server-only.crt/.key, gateway.*


def _ca_extensions() -> list[tuple[x509.ExtensionType, bool]]:
    usage = x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=True,
        crl_sign=True,
        encipher_only=False,
        decipher_only=False,
    )
    return [(x509.BasicConstraints(ca=True, path_length=0), True), (usage, True)]


def _leaf(
    usages: list[x509.ObjectIdentifier], names: bool
) -> list[tuple[x509.ExtensionType, bool]]:
    extensions: list[tuple[x509.ExtensionType, bool]] = [
        (x509.BasicConstraints(ca=False, path_length=None), True),
        (x509.ExtendedKeyUsage(usages), False),
    ]
    if names:
        alt = [x509.DNSName(ENGINE), x509.IPAddress(ipaddress.ip_address(PUBLIC_IP))]
        extensions.append((x509.SubjectAlternativeName(alt), False))
    return extensions


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> DeploymentPki:
    directory = tmp_path_factory.mktemp("deployment-pki")
    ca = _issue("fedllm federation CA", None, _ca_extensions())
    server, client = ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH
    _write(directory / "ca", ca[0], None)
    # What infra/terraform/modules/*_site issue: serverAuth and clientAuth, DNS name and address.
    _write(directory / "engine", *_issue(ENGINE, ca, _leaf([server, client], names=True)))
    # The same without clientAuth: what the sites had before the probe presented it.
    _write(directory / "server-only", *_issue(ENGINE, ca, _leaf([server], names=True)))
    _write(directory / "gateway", *_issue("fedllm-gateway", ca, _leaf([client], names=False)))
    return DeploymentPki(directory)


@pytest.fixture(scope="module")
def other_pki(tmp_path_factory: pytest.TempPathFactory) -> TestPki:
    return make_pki(tmp_path_factory.mktemp("other-pki"), ca_name="someone else's CA")


def _tls_env(pki: DeploymentPki) -> dict[str, str]:
    # What modules/site_boot puts into the container's environment.
    return {
        "SITE_TLS_CERT": str(pki.directory / "engine.crt"),
        "SITE_TLS_KEY": str(pki.directory / "engine.key"),
        "SITE_TLS_CLIENT_CA": str(pki.directory / "ca.crt"),
    }


@pytest.fixture(scope="module")
def site(
    pki: DeploymentPki, tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ManagedProcess]:
    process = start_site(
        model_dir=tiny_llama_dir,
        site_name=ENGINE,
        model_name="tiny",
        log_dir=tmp_path_factory.mktemp("logs"),
        env=_tls_env(pki),
    )
    yield process
    process.stop()


def _container_env(port: int, model_dir: Path, tls: dict[str, str]) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SITE_")}
    return {
        **base,
        "SITE_PORT": str(port),
        "SITE_MODEL_DIR": str(model_dir),
        "SITE_SITE_NAME": ENGINE,
        **tls,
    }


def _probe(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "site_engine.healthcheck", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_probe_names_the_engine_by_its_certificates_dns_name(pki: DeploymentPki) -> None:
    assert certificate_dns_names(pki.directory / "engine.crt") == [ENGINE]
    settings = SiteSettings.load(_tls_env(pki), model_dir="m", site_name="elsewhere")
    tls = load_probe_tls(settings)
    assert tls is not None
    assert tls.server_name == ENGINE
    assert tls.certificate_chain == (pki.directory / "engine.crt").read_bytes()
    assert "PRIVATE" not in repr(tls)
    assert load_probe_tls(SiteSettings.load({}, model_dir="m")) is None


def test_with_the_engines_own_settings_the_probe_finds_a_tls_site_healthy(
    site: ManagedProcess, pki: DeploymentPki, tiny_llama_dir: Path
) -> None:
    checked = _probe(_container_env(site.port, tiny_llama_dir, _tls_env(pki)))
    assert checked.returncode == 0, checked.stderr


def test_the_gateways_credentials_given_as_flags_are_admitted_too(
    site: ManagedProcess, pki: DeploymentPki, tiny_llama_dir: Path
) -> None:
    env = _container_env(site.port, tiny_llama_dir, _tls_env(pki))
    d = pki.directory
    checked = _probe(env, "--tls-cert", str(d / "gateway.crt"), "--tls-key", str(d / "gateway.key"))
    assert checked.returncode == 0, checked.stderr


def test_a_plaintext_probe_calls_a_tls_site_unhealthy(
    site: ManagedProcess, tiny_llama_dir: Path
) -> None:
    checked = _probe(_container_env(site.port, tiny_llama_dir, {}))
    assert checked.returncode == 1
    assert "unhealthy" in checked.stderr
    assert "plaintext" in checked.stderr


@pytest.mark.parametrize(
    "credentials",
    ["server-only", "other-ca", "wrong-name", "untrusted-server"],
)
def test_the_probe_without_the_right_credentials_calls_the_site_unhealthy(
    site: ManagedProcess,
    pki: DeploymentPki,
    other_pki: TestPki,
    tiny_llama_dir: Path,
    credentials: str,
) -> None:
    env = _container_env(site.port, tiny_llama_dir, _tls_env(pki))
    d = pki.directory
    args = {
        # A certificate of the right CA but without clientAuth: the site refuses it as a client.
        "server-only": [
            "--tls-cert",
            str(d / "server-only.crt"),
            "--tls-key",
            str(d / "server-only.key"),
        ],
        # A client certificate the site's client CA did not sign.
        "other-ca": [
            "--tls-cert",
            str(other_pki.client_cert),
            "--tls-key",
            str(other_pki.client_key),
        ],
        # A name the engine's certificate does not carry.
        "wrong-name": ["--server-name", "aws-use1-2"],
        # Trusting another CA than the one that signed the engine's certificate.
        "untrusted-server": ["--tls-ca", str(other_pki.ca_cert)],
    }[credentials]
    checked = _probe(env, *args)
    assert checked.returncode == 1, checked.stderr
    assert "unhealthy" in checked.stderr
    assert "TLS" in checked.stderr
