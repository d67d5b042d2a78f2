"""Every engine of the example site map boots with a valid script and a valid engine configuration:
the boot script each site module renders (modules/site_boot) is evaluated from the HCL, checked by
bash, and its container environment is loaded by the engine's own settings."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fedllm_contract.env_settings import variables
from site_engine.settings import SiteSettings
from tests.infra.containers import DOCKER_DIR, environment
from tests.infra.deployment import (
    SITE_MODULES,
    addresses_for,
    call_arguments,
    certificate_outputs,
    render_root,
    resource_doubles,
    tfvars,
    variable_values,
)
from tests.infra.hcl_eval import Evaluator
from tests.infra.hcl_tree import TERRAFORM_DIR, ModuleConfig


@dataclass
class Engine:
    cloud: str
    name: str
    inputs: dict[str, Any]  # what the site module's boot call passes to modules/site_boot
    script: str
    environment: dict[str, str]


def _engines(root: ModuleConfig) -> list[Engine]:
    rendered = render_root(root, tfvars(), addresses_for())
    boot = ModuleConfig.load(TERRAFORM_DIR / "modules" / "site_boot")
    engines = []
    for (call, _site), inputs in sorted(rendered.site_inputs.items()):
        module = ModuleConfig.load(TERRAFORM_DIR / "modules" / call)
        boot_call = module.module_calls["boot"].attributes
        names = inputs["instance_names"]
        evaluator = Evaluator(
            variables=variable_values(module, inputs),
            locals=module.locals,
            directory=module.directory,
            roots=resource_doubles(list(boot_call.values()), names),
        )
        for name, index in evaluator.evaluate(
            module.module_calls["boot"].attributes["for_each"]
        ).items():
            boot_inputs = call_arguments(
                boot_call, evaluator, {"each": {"key": name, "value": index}}
            )
            rendered_boot = Evaluator(
                variables=variable_values(boot, boot_inputs),
                locals=boot.locals,
                directory=boot.directory,
            )
            engines.append(
                Engine(
                    SITE_MODULES[call],
                    name,
                    boot_inputs,
                    rendered_boot.local("script"),
                    rendered_boot.local("environment"),
                )
            )
    return engines


@pytest.fixture(scope="module")
def engines(root: ModuleConfig) -> list[Engine]:
    return _engines(root)


def test_every_engine_of_the_example_gets_a_boot_script(
    engines: list[Engine], root: ModuleConfig
) -> None:
    names = render_root(root, tfvars(), addresses_for()).local("instance_names")
    assert sorted(e.name for e in engines) == sorted(n for ns in names.values() for n in ns)
    assert {e.cloud for e in engines} == {"aws", "gcp", "azure"}


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash to check the scripts")
def test_every_boot_script_is_valid_bash(engines: list[Engine]) -> None:
    for engine in engines:
        checked = subprocess.run(
            ["bash", "-n"], input=engine.script, text=True, capture_output=True, check=False
        )
        assert checked.returncode == 0, f"{engine.name}: {checked.stderr}"


def test_each_script_fetches_its_own_bundle_from_its_clouds_secret_manager(
    engines: list[Engine],
) -> None:
    fetch = {
        "aws": r"aws secretsmanager get-secret-value .*<aws_secretsmanager_secret\.bundle\.arn>",
        "gcp": r"secretmanager\.googleapis\.com/v1/projects/example-fedllm/secrets/"
        r"<google_secret_manager_secret\.bundle\.secret_id>/versions/latest:access",
        "azure": r"<azurerm_key_vault\.site\.vault_uri>secrets/{name}-bundle\?api-version",
    }
    for engine in engines:
        body = engine.script.split("fetch_bundle() {", 1)[1].split("\n}\n", 1)[0]
        assert re.search(fetch[engine.cloud].format(name=re.escape(engine.name)), body), engine.name


def test_the_container_environment_is_valid_engine_settings(engines: list[Engine]) -> None:
    image_env = environment(DOCKER_DIR / "site.Dockerfile")
    setting_names = {v.name for v in variables(SiteSettings)}
    entrypoint = (DOCKER_DIR / "site-entrypoint.sh").read_text()
    example = tfvars()
    for engine in engines:
        env = {**image_env, **engine.environment}
        for key in engine.environment:
            assert key in setting_names or (key.startswith("FEDLLM_") and key in entrypoint), key
        settings = SiteSettings.load(env)
        model = engine.inputs["model"]
        assert settings.site_name == engine.name
        assert settings.model_name == model["name"]
        assert str(settings.model_dir).endswith(f"/{model['name']}/{model['hf_revision']}")
        assert settings.device == "cuda"
        assert settings.host == "0.0.0.0"
        site = next(s for n, s in example["sites"].items() if engine.name.startswith(n))
        for key, value in site.get("settings", {}).items():
            assert env[key] == value


def test_the_script_starts_the_image_with_that_environment_on_the_published_port(
    engines: list[Engine],
) -> None:
    # The image alone (no TLS files yet) is refused on 0.0.0.0; only its port is read here.
    container_port = SiteSettings.load(
        environment(DOCKER_DIR / "site.Dockerfile"), model_dir="m", allow_plaintext=True
    ).port
    for engine in engines:
        written = engine.script.split("<<'ENVIRONMENT'\n", 1)[1].split("\nENVIRONMENT\n", 1)[0]
        assert dict(line.split("=", 1) for line in written.splitlines()) == engine.environment
        assert f"--publish '{engine.inputs['grpc_port']}:{container_port}'" in engine.script
        assert f"readonly IMAGE='{engine.inputs['image']}'" in engine.script
        assert "--gpus all" in engine.script


def test_the_engine_serves_mutual_tls_from_the_files_the_script_writes(
    engines: list[Engine], tmp_path: Path
) -> None:
    # The bundle-writing step of each script, run on a bundle into a scratch directory: the
    # files it writes are the ones the container's SITE_TLS_* name, mounted at the same path.
    bundle = {"ca_pem": "CA\n", "cert_pem": "CERT\n", "key_pem": "KEY\n", "hf_token": "hf_x"}
    content = {"SITE_TLS_CERT": "CERT\n", "SITE_TLS_KEY": "KEY\n", "SITE_TLS_CLIENT_CA": "CA\n"}
    for engine in engines:
        step = re.search(r"python3 -c '\n(.*?)\n' '([^']*)' '([^']*)'\n", engine.script, re.S)
        assert step is not None, engine.name
        code, files, tls_dir = step.groups()
        assert f"--volume '{tls_dir}:{tls_dir}:ro'" in engine.script
        target = tmp_path / engine.name
        target.mkdir()
        code = code.replace("os.chown(", "(lambda *a: None)(")  # needs root; ownership aside
        code = code.replace('"/etc/fedllm/secrets.env"', repr(str(target / "secrets.env")))
        run = subprocess.run(
            [sys.executable, "-c", code, files, str(target)],
            input=json.dumps(bundle),
            text=True,
            capture_output=True,
            check=False,
        )
        assert run.returncode == 0, run.stderr
        for setting, expected in content.items():
            path = Path(engine.environment[setting])
            assert path.parent == Path(tls_dir), setting
            written = target / path.name
            assert written.read_text() == expected, setting
            assert written.stat().st_mode & 0o777 == 0o400
        settings = SiteSettings.load(engine.environment)
        assert (settings.tls_cert, settings.tls_key, settings.tls_client_ca) == tuple(
            Path(engine.environment[s]) for s in content
        )
        # A bundle without its certificate stops the boot rather than starting plaintext.
        partial = subprocess.run(
            [sys.executable, "-c", code, files, str(target)],
            input=json.dumps({**bundle, "cert_pem": ""}),
            text=True,
            capture_output=True,
            check=False,
        )
        assert partial.returncode != 0


def test_each_engine_certificate_admits_the_probe_and_names_the_engine(root: ModuleConfig) -> None:
    for call in SITE_MODULES:
        module = ModuleConfig.load(TERRAFORM_DIR / "modules" / call)
        signed = module.resources[("tls_locally_signed_cert", "engine")].attributes
        uses = Evaluator(directory=module.directory).evaluate(signed["allowed_uses"])
        # serverAuth for the gateway; clientAuth for the container's health probe.
        assert {"server_auth", "client_auth"} <= set(uses), call
    rendered = render_root(root, tfvars(), addresses_for())
    for (call, _site), inputs in rendered.site_inputs.items():
        names = certificate_outputs(call, inputs)["tls_server_names"]
        assert names == inputs["instance_names"], call
