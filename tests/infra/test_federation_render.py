"""The site map of example.tfvars, rendered by the root's own expressions (federation.tf), is a
federation file the gateway accepts and runs with, so the Terraform and the gateway cannot drift.

Only what a cloud would return (the engines' addresses) is supplied by the test; the names,
models, weights, the file and the container environment come from evaluating the HCL."""

from __future__ import annotations

import copy
import os
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from devtools.forkserver import FORK_SERVER_ENV
from devtools.launch import (
    GATEWAY_PYTHON_ENV,
    ManagedProcess,
    free_port,
    gateway_python,
    readiness,
    spawn_site,
    wait_until_serving,
)
from fedllm_contract.env_settings import variables
from gateway.db.migrate import downgrade
from gateway.federation import load_federation, parse_federation
from gateway.settings import GatewaySettings
from tests.infra.containers import DOCKER_DIR, exec_form, one
from tests.infra.deployment import (
    INFRASTRUCTURE_OUTPUTS,
    RenderedRoot,
    addresses_for,
    certificate_outputs,
    render_root,
    tfvars,
)
from tests.infra.gateway_render import gateway_container_env, gateway_secrets
from tests.infra.hcl_tree import ModuleConfig
from tests.support.tls_certs import make_pki

# Variables of the test run itself (which interpreter runs gateways, how they are launched), not
# of a container's environment.
TEST_RUN_ONLY = (GATEWAY_PYTHON_ENV, FORK_SERVER_ENV)

GATEWAY_ENTRYPOINT = DOCKER_DIR / "gateway-entrypoint.sh"


@pytest.fixture(scope="module")
def example() -> dict[str, Any]:
    return tfvars()


@pytest.fixture(scope="module")
def rendered(root: ModuleConfig, example: dict[str, Any]) -> RenderedRoot:
    return render_root(root, example, addresses_for())


def test_the_rendered_file_is_a_federation_the_gateway_accepts(
    rendered: RenderedRoot, example: dict[str, Any], tmp_path: Path
) -> None:
    # Exactly what the gateway container receives, parsed by the gateway's own loader.
    text = rendered.local("gateway_environment")["FEDLLM_FEDERATION_JSON"]
    federation = parse_federation(text.encode(), tmp_path)

    external = example.get("openai_sites", {})
    for name, site in external.items():
        (joined,) = [s for s in federation.sites if s.name == name]
        assert joined.kind == "openai"
        assert joined.openai is not None
        assert joined.openai.base_url == site["base_url"].rstrip("/")
        assert joined.openai.metrics_dialect == site["metrics_dialect"]
        assert joined.openai.api_key_file == (tmp_path / site["api_key_file"]).resolve()
    deployed = [s for s in federation.sites if s.kind == "grpc"]
    engines = Counter(site.name.rsplit("-", 1)[0] for site in deployed)
    for name, site in example["sites"].items():
        mine = [s for s in deployed if s.name == name or s.name.startswith(f"{name}-")]
        assert len(mine) == site.get("count", 1), name
        for engine in mine:
            assert (engine.cloud, engine.region, engine.model) == (
                site["cloud"],
                site["region"],
                site["model"],
            )
            assert engine.capacity_weight == site.get("capacity_weight", 1)
    assert sum(engines.values()) == sum(s.get("count", 1) for s in example["sites"].values())

    # Every engine gets the address its site module returned, each address once.
    returned = [
        endpoint
        for site in rendered.evaluator.modules.values()
        if isinstance(site, dict)
        for outputs in site.values()
        if isinstance(outputs, dict) and "endpoints" in outputs
        for endpoint in outputs["endpoints"]
    ]
    assert sorted(s.endpoint for s in federation.sites if s.kind == "grpc") == sorted(returned)

    # Each engine is checked for the DNS name its site module put in its certificate: its name.
    named = {
        endpoint: server_name
        for site in rendered.evaluator.modules.values()
        if isinstance(site, dict)
        for outputs in site.values()
        if isinstance(outputs, dict) and "tls_server_names" in outputs
        for endpoint, server_name in zip(
            outputs["endpoints"], outputs["tls_server_names"], strict=True
        )
    }
    deployed = [s for s in federation.sites if s.kind == "grpc"]
    assert {s.endpoint: s.tls_server_name for s in deployed} == named
    assert all(s.tls_server_name == s.name for s in deployed)

    # Models some site serves, each with its tokenizer next to the file; unused ones are left out.
    served = {site["model"] for site in example["sites"].values()}
    assert {m.name for m in federation.models} == served < set(example["models"])
    assert all(m.tokenizer == (tmp_path / "models" / m.name).resolve() for m in federation.models)


def test_a_single_engine_keeps_the_site_name_and_several_are_numbered(
    rendered: RenderedRoot, example: dict[str, Any]
) -> None:
    names = rendered.local("instance_names")
    assert set(names) == set(example["sites"])
    for site, engines in names.items():
        count = example["sites"][site].get("count", 1)
        expected = [site] if count == 1 else [f"{site}-{i}" for i in range(1, count + 1)]
        assert engines == expected


def test_a_draining_site_keeps_its_engines_but_leaves_the_federation(
    root: ModuleConfig, example: dict[str, Any], tmp_path: Path
) -> None:
    given = copy.deepcopy(example)
    given["sites"]["azure-swc"]["drain"] = True  # the only site serving llama
    rendered = render_root(root, given, addresses_for())
    assert ("azure_site", "azure-swc") in rendered.site_inputs  # still deployed
    text = rendered.local("gateway_environment")["FEDLLM_FEDERATION_JSON"]
    federation = parse_federation(text.encode(), tmp_path)
    assert "azure-swc" not in {s.name for s in federation.sites}
    assert "aws-apne1" in {s.name for s in federation.sites}  # llama is still served there
    given["sites"]["aws-apne1"]["drain"] = True
    drained = render_root(root, given, addresses_for()).local("federation")
    assert {m["name"] for m in drained["models"]} == {"qwen2.5-7b-instruct"}


def test_the_gateway_container_environment_is_valid_gateway_settings(
    root: ModuleConfig, rendered: RenderedRoot, example: dict[str, Any]
) -> None:
    env = gateway_container_env(root, rendered)
    known = {v.name for v in variables(GatewaySettings)}
    assert {k for k in env if k.startswith("GATEWAY_")} <= known
    settings = GatewaySettings.from_env({**env, **gateway_secrets(root, rendered)})
    assert settings.routing.policy == example["gateway"]["routing_policy"]
    assert settings.server.host == "0.0.0.0"
    assert settings.server.port == 8000
    # No password in the URL: it arrives as PGPASSWORD from Secrets Manager.
    assert settings.database.url.startswith("postgresql+psycopg://fedllm@")
    assert "sslmode=require" in settings.database.url
    for key, value in example["gateway"]["settings"].items():
        assert env[key] == value


def test_the_gateway_bundle_delivers_the_pkis_ca_and_client_certificate(
    root: ModuleConfig, rendered: RenderedRoot
) -> None:
    secrets = gateway_secrets(root, rendered)
    pki = INFRASTRUCTURE_OUTPUTS["pki"]
    assert secrets["FEDLLM_TLS_CA_PEM"] == pki["ca_cert_pem"]
    assert secrets["FEDLLM_TLS_CERT_PEM"] == pki["gateway_cert_pem"]
    assert secrets["FEDLLM_TLS_KEY_PEM"] == pki["gateway_private_key_pem"]
    # The entrypoint turns exactly these into the gateway's GATEWAY_SITE_TLS_* files.
    entrypoint = GATEWAY_ENTRYPOINT.read_text()
    for name in ("FEDLLM_TLS_CA_PEM", "FEDLLM_TLS_CERT_PEM", "FEDLLM_TLS_KEY_PEM"):
        assert name in entrypoint


def _live_sites(
    tiny_model: Path, models: set[str], work: Path, env: dict[str, str]
) -> dict[str, ManagedProcess]:
    sites = {
        model: spawn_site(
            model_dir=tiny_model, site_name=model, model_name=model, log_dir=work, env=env
        )
        for model in sorted(models)
    }
    for process in sites.values():
        wait_until_serving(process)
    return sites


def _wait_ready(process: ManagedProcess, engines: int, timeout_s: float = 120.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    body: dict[str, Any] = {}
    while time.monotonic() < deadline:
        if not process.alive():
            pytest.fail(f"gateway exited:\n{process.log_tail()}")
        try:
            body = readiness(process, timeout_s=2)
        except (httpx.HTTPError, ValueError):
            body = {}
        if sum(bool(v) for v in body.get("sites", {}).values()) == engines:
            return body
        time.sleep(0.3)
    pytest.fail(f"not every engine became healthy: {body}\n{process.log_tail()}")


@pytest.mark.slow
@pytest.mark.postgres
def test_a_gateway_started_like_its_container_serves_every_rendered_engine(
    root: ModuleConfig,
    example: dict[str, Any],
    tiny_llama_dir: Path,
    postgres_url: str,
    tmp_path: Path,
) -> None:
    # The example's external engine (openai_sites) is reached over the network and its key file
    # lives on a real gateway host: its rendering is checked above, the live start without it.
    example = {**example, "openai_sites": {}}
    served = {site["model"] for site in example["sites"].values()}
    # Mutual TLS as deployed: the live sites serve a certificate naming every engine they stand
    # for (the names the site modules put in the engines' certificates, which the federation
    # file asks for) and admit only the gateway's certificate, whose CA and key reach the
    # gateway through its secret bundle and the entrypoint.
    names = render_root(root, example, addresses_for()).local("federation")["sites"]
    real = make_pki(tmp_path / "pki", server_dns=tuple(s["tls_server_name"] for s in names))
    pki = {
        "ca_cert_pem": real.ca_cert.read_text(),
        "ca_private_key_pem": INFRASTRUCTURE_OUTPUTS["pki"]["ca_private_key_pem"],
        "gateway_cert_pem": real.client_cert.read_text(),
        "gateway_private_key_pem": real.client_key.read_text(),
    }
    started: list[ManagedProcess] = []
    try:
        sites = _live_sites(tiny_llama_dir, served, tmp_path, real.site_env())
        started += sites.values()

        # The cloud's part: every engine of a model answers at that model's live site.
        def at_live_sites(call: str, site: str, inputs: dict[str, Any]) -> dict[str, Any]:
            endpoint = f"127.0.0.1:{sites[inputs['model']['name']].port}"
            return {
                "endpoints": [endpoint for _ in inputs["instance_names"]],
                "public_ips": ["127.0.0.1" for _ in inputs["instance_names"]],
                **certificate_outputs(call, inputs),
            }

        rendered = render_root(root, example, at_live_sites, {"pki": pki})
        env = gateway_container_env(root, rendered)
        env.update(gateway_secrets(root, rendered))
        state = tmp_path / "state"
        for model in served:  # what the entrypoint would download from FEDLLM_MODELS
            (state / "models").mkdir(parents=True, exist_ok=True)
            (state / "models" / model).symlink_to(tiny_llama_dir)
        port = free_port()
        python = gateway_python()  # as the image has it: the gateway's dependencies, no torch
        env.update(
            {
                "PATH": f"{Path(python).parent}{os.pathsep}{os.environ['PATH']}",
                "GATEWAY_FEDERATION_FILE": str(state / "federation.json"),
                "GATEWAY_DATABASE_URL": postgres_url,
                "GATEWAY_HOST": "127.0.0.1",
                "GATEWAY_PORT": str(port),
                "GATEWAY_HEALTH_INTERVAL_S": "0.5",
            }
        )
        log = tmp_path / "gateway.log"
        with log.open("wb") as output:
            popen = subprocess.Popen(
                ["sh", str(GATEWAY_ENTRYPOINT), python, "-m", "gateway"],
                stdout=output,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                # What a container gets: no variable of the test run's own (the interpreter
                # choice above is one).
                env={**{k: v for k, v in os.environ.items() if k not in TEST_RUN_ONLY}, **env},
            )
        gateway = ManagedProcess(
            "gateway", popen, log, port, admin_token=env["GATEWAY_ADMIN_TOKEN"]
        )
        started.append(gateway)
        ready = _wait_ready(gateway, len(rendered.local("federation")["sites"]))
        federation = load_federation(state / "federation.json")
        assert set(ready["sites"]) == {s.name for s in federation.sites}

        # The entrypoint wrote the files and kept the material out of the gateway's environment.
        assert (state / "tls" / "key.pem").read_text() == pki["gateway_private_key_pem"]
        assert (state / "tls" / "key.pem").stat().st_mode & 0o077 == 0
        gateway_env = Path(f"/proc/{popen.pid}/environ").read_bytes().split(b"\0")
        assert not [v for v in gateway_env if v.startswith(b"FEDLLM_")]
        assert f"GATEWAY_SITE_TLS_KEY={state / 'tls' / 'key.pem'}".encode() in gateway_env

        # The image's HEALTHCHECK (and ECS's copy of it) passes against this gateway.
        probe = exec_form(one(DOCKER_DIR / "gateway.Dockerfile", "HEALTHCHECK"))
        checked = subprocess.run(
            [python, *probe[1:]], env={**os.environ, "GATEWAY_PORT": str(port)}, timeout=30
        )
        assert checked.returncode == 0

        base = f"http://127.0.0.1:{port}"
        # The deployment requires API keys: none is a 401, one made through the admin API serves.
        assert httpx.get(f"{base}/v1/models", timeout=10).status_code == 401
        admin = {"Authorization": f"Bearer {env['GATEWAY_ADMIN_TOKEN']}"}
        made = httpx.post(f"{base}/admin/api/keys", json={"name": "t"}, headers=admin, timeout=10)
        client = {"Authorization": f"Bearer {made.json()['key']}"}
        listed = httpx.get(f"{base}/v1/models", headers=client, timeout=10).json()
        assert sorted(m["id"] for m in listed["data"]) == sorted(served)
        for model in sorted(served):
            engines = {s.name for s in federation.sites if s.model == model}
            response = httpx.post(
                f"{base}/v1/completions",
                json={"model": model, "prompt": "Hello", "max_tokens": 4},
                headers=client,
                timeout=60,
            )
            assert response.status_code == 200, response.text
            assert response.headers["x-fedllm-site"] in engines
    finally:
        for process in reversed(started):
            process.stop()
        downgrade(postgres_url)  # the session's database is shared: leave it empty
