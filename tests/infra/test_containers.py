"""The container images: what their Dockerfiles declare, what their entrypoints do, and that their
health checks ask the services' real health endpoints."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from fnmatch import fnmatch
from pathlib import Path

import pytest

from devtools.launch import free_port, start_site
from fedllm_contract.env_settings import variables
from gateway.api.admin_auth import require_admin
from gateway.app import create_app
from gateway.retrain_predictor import parse_args
from gateway.settings import GatewaySettings
from site_engine.settings import SiteSettings
from tests.infra.containers import (
    DOCKER_DIR,
    environment,
    exec_form,
    final_stage,
    instructions,
    one,
)
from tests.infra.deployment import (
    addresses_for,
    module_inputs,
    module_locals,
    render_root,
    resource_doubles,
    tfvars,
    variable_values,
)
from tests.infra.hcl_eval import Evaluator, literal
from tests.infra.hcl_tree import TERRAFORM_DIR, ModuleConfig

REPO = DOCKER_DIR.parent
IMAGES = {"gateway": DOCKER_DIR / "gateway.Dockerfile", "site": DOCKER_DIR / "site.Dockerfile"}


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_images_run_their_service_as_an_unprivileged_user(image: str) -> None:
    dockerfile = IMAGES[image]
    assert one(dockerfile, "USER").arguments == "10001:10001"
    entrypoint = exec_form(one(dockerfile, "ENTRYPOINT"))
    copied = [i.arguments.split()[-2:] for i in final_stage(dockerfile) if i.keyword == "COPY"]
    script = next(src for src, dest in copied if dest == entrypoint[0])
    assert (REPO / script).is_file()
    command = exec_form(one(dockerfile, "CMD"))
    assert command[:2] == ["python", "-m"]
    module = {"gateway": "gateway", "site": "site_engine"}[image]
    assert command[2] == module
    assert importlib.util.find_spec(f"{module}.__main__") is not None


def test_the_site_image_is_built_on_cuda_and_the_gateway_image_without_it() -> None:
    site_bases = [i.arguments for i in instructions(IMAGES["site"]) if i.keyword == "FROM"]
    assert site_bases
    assert all(base.startswith("nvidia/cuda:") for base in site_bases)
    gateway = IMAGES["gateway"].read_text()
    assert "nvidia" not in gateway


def test_the_gateway_image_installs_no_torch_and_no_site_engine() -> None:
    """The served image's venv comes from the build stage, which copies no site_engine and
    installs the core dependencies only (torch is in the `site` and `train` extras)."""
    everything = instructions(IMAGES["gateway"])
    (copied,) = [i for i in final_stage(IMAGES["gateway"]) if "--from=build " in f"{i.arguments} "]
    build = [i for i in everything if i.stage == 1]
    assert build[0].arguments.endswith("AS build")
    assert not any("site_engine" in i.arguments or "torch" in i.arguments for i in build)
    (install,) = [i for i in build if i.keyword == "RUN" and "pip install" in i.arguments]
    assert install.arguments.endswith("pip install -c constraints.txt .")
    assert copied.arguments.split()[-1] == "/opt/fedllm"


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_image_settings_are_real_settings(image: str) -> None:
    prefix, cls = ("GATEWAY_", GatewaySettings) if image == "gateway" else ("SITE_", SiteSettings)
    names = {v.name for v in variables(cls)}
    env = environment(IMAGES[image])
    assert {k for k in env if k.startswith(prefix)} <= names


def test_every_copied_path_survives_the_dockerignore() -> None:
    rules = [r for r in (REPO / ".dockerignore").read_text().splitlines() if r and r[0] != "#"]
    assert rules[0] == "*", "the context starts empty and lists what images need"
    included = {r[1:].rstrip("/") for r in rules if r.startswith("!")}
    for dockerfile in IMAGES.values():
        for instruction in instructions(dockerfile):
            if instruction.keyword == "COPY" and "--from=" not in instruction.arguments:
                sources = [a for a in instruction.arguments.split()[:-1] if not a.startswith("--")]
                for source in sources:
                    parents = {"/".join(source.split("/")[:n]) for n in range(1, 99)}
                    assert parents & included, f"{dockerfile.name}: {source}"
    assert not included & {"tests", ".venv", "var", ".git"}


def _run(script: str, env: dict[str, str], *command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["sh", str(DOCKER_DIR / script), *command],
        env={"PATH": os.environ["PATH"], **env},
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )


def _fake_hf(directory: Path) -> Path:
    """Stands in for the Hugging Face CLI (the network): records its arguments, writes a file."""
    directory.mkdir()
    log = directory / "calls"
    fake = directory / "hf"
    fake.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> {log}\n'
        'while [ $# -gt 0 ]; do [ "$1" = --local-dir ] && dir="$2"; shift; done\n'
        'mkdir -p "$dir" && echo "{}" > "$dir/tokenizer.json"\n'
    )
    fake.chmod(0o755)
    return log


def test_the_gateway_entrypoint_turns_its_environment_into_files(tmp_path: Path) -> None:
    log = _fake_hf(tmp_path / "bin")
    state = tmp_path / "state"
    (state / "models" / "cached").mkdir(parents=True)
    (state / "models" / "cached" / "tokenizer.json").write_text("{}")
    federation: dict[str, list[object]] = {"models": [], "sites": []}
    env = {
        "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
        "GATEWAY_FEDERATION_FILE": str(state / "federation.json"),
        "FEDLLM_FEDERATION_JSON": json.dumps(federation),
        "FEDLLM_MODELS": json.dumps(
            {
                "fresh": {"hf_repo": "org/fresh", "hf_revision": "abc123"},
                "cached": {"hf_repo": "org/cached", "hf_revision": "main"},
            }
        ),
        "FEDLLM_TLS_CA_PEM": "CA",
        "FEDLLM_TLS_CERT_PEM": "CERT",
        "FEDLLM_TLS_KEY_PEM": "KEY",
        "HF_TOKEN": "hf_secret",
    }
    done = _run("gateway-entrypoint.sh", env, "env")
    assert done.returncode == 0, done.stderr
    assert json.loads((state / "federation.json").read_text()) == federation
    calls = log.read_text().splitlines()
    assert len(calls) == 1  # the tokenizer already present is not fetched again
    assert calls[0].startswith(
        f"download org/fresh --revision abc123 --local-dir {state}/models/fresh"
    )
    passed_on = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    assert not [k for k in passed_on if k.startswith("FEDLLM_")]
    # Each PEM is a file only its owner reads, named to the gateway by its GATEWAY_SITE_TLS_*.
    for setting, content in (("CA", "CA"), ("CERT", "CERT"), ("KEY", "KEY")):
        path = Path(passed_on[f"GATEWAY_SITE_TLS_{setting}"])
        assert path.parent == state / "tls"
        assert path.read_text() == f"{content}\n"
        assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert sorted(p.name for p in (state / "tls").iterdir()) == ["ca.pem", "cert.pem", "key.pem"]


def test_the_gateway_entrypoint_refuses_part_of_the_tls_material(tmp_path: Path) -> None:
    env = {"GATEWAY_FEDERATION_FILE": str(tmp_path / "f.json"), "FEDLLM_TLS_KEY_PEM": "KEY"}
    done = _run("gateway-entrypoint.sh", env, "echo", "started")
    assert done.returncode != 0
    assert "all three or none" in done.stderr
    assert "started" not in done.stdout
    # None at all: plaintext, no TLS setting invented.
    done = _run(
        "gateway-entrypoint.sh", {"GATEWAY_FEDERATION_FILE": str(tmp_path / "f.json")}, "env"
    )
    assert done.returncode == 0, done.stderr
    assert "GATEWAY_SITE_TLS" not in done.stdout


def test_the_gateway_entrypoint_stops_on_a_malformed_model_list(tmp_path: Path) -> None:
    env = {"GATEWAY_FEDERATION_FILE": str(tmp_path / "f.json"), "FEDLLM_MODELS": "{not json"}
    done = _run("gateway-entrypoint.sh", env, "echo", "started")
    assert done.returncode != 0
    assert "started" not in done.stdout


def test_the_site_entrypoint_downloads_the_weights_once(tmp_path: Path) -> None:
    log = _fake_hf(tmp_path / "bin")
    env = {
        "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
        "SITE_MODEL_DIR": str(tmp_path / "models" / "m" / "rev1"),
        "FEDLLM_HF_REPO": "org/m",
        "FEDLLM_HF_REVISION": "rev1",
        "HF_TOKEN": "hf_secret",
    }
    for _ in range(2):
        done = _run("site-entrypoint.sh", env, "env")
        assert done.returncode == 0, done.stderr
        assert "HF_TOKEN=" not in done.stdout
    assert len(log.read_text().splitlines()) == 1
    assert (tmp_path / "models" / "m" / "rev1" / ".fedllm-download-complete").exists()


def test_the_ecs_health_check_is_the_images_health_check(root: ModuleConfig) -> None:

    gateway = ModuleConfig.load(TERRAFORM_DIR / "modules" / "aws_gateway")
    rendered = render_root(root, tfvars(), addresses_for())
    evaluator = module_locals(
        gateway,
        module_inputs(root, rendered, "gateway"),
        overrides={"aws_db_instance.gateway.port": 5432},
        keys=[],
    )
    container = evaluator.local("container")
    image_check = exec_form(one(IMAGES["gateway"], "HEALTHCHECK"))
    assert container["healthCheck"]["command"] == ["CMD", *image_check]
    assert "healthCheck" not in evaluator.local("retrain_container")


def test_the_retrain_task_runs_the_trainer_image_with_a_command_it_accepts(
    root: ModuleConfig,
) -> None:
    gateway = ModuleConfig.load(TERRAFORM_DIR / "modules" / "aws_gateway")
    example = tfvars()
    rendered = render_root(root, example, addresses_for())
    output = gateway.outputs["retrain_command"].attributes["value"]
    evaluator = Evaluator(
        variables=variable_values(gateway, module_inputs(root, rendered, "gateway")),
        locals=gateway.locals,
        directory=gateway.directory,
        roots=resource_doubles([*gateway.locals.values(), output], []),
    )
    container = evaluator.local("retrain_container")
    assert container["image"] == example["gateway"]["trainer_image"] != example["gateway"]["image"]
    # The gateway image has no torch; the trainer target installs the training extras.
    stages = instructions(IMAGES["gateway"])
    build = [i for i in stages if i.stage == _stage(" AS build-trainer") and i.keyword == "RUN"]
    assert any('.[train]"' in i.arguments for i in build)
    trainer = [i for i in stages if i.stage == _stage(" AS trainer") and i.keyword == "COPY"]
    assert any(i.arguments.startswith("--from=build-trainer ") for i in trainer)
    # Retraining reads the database; the admin token and the sites' TLS key stay out.
    assert [e["name"] for e in container["environment"]] == ["GATEWAY_DATABASE_URL"]
    assert {"PGPASSWORD"} <= {s["name"] for s in container["secrets"]} <= {"PGPASSWORD", "HF_TOKEN"}
    # What the operator runs: the override's command is one the retrain command accepts.
    words = shlex.split(str(evaluator.evaluate(output)))
    overrides = json.loads(words[words.index("--overrides") + 1])
    (override,) = overrides["containerOverrides"]
    assert override["name"] == container["name"]
    program, flag, module, *arguments = override["command"]
    assert (program, flag, module) == ("python", "-m", "gateway.retrain_predictor")
    args = parse_args(arguments)  # argparse exits on a flag it does not know
    assert args.out.parent == Path(evaluator.local("predictor_mount"))
    assert args.activate == "if-better"


def _stage(suffix: str) -> int:
    (stage,) = [
        i.stage
        for i in instructions(IMAGES["gateway"])
        if i.keyword == "FROM" and i.arguments.endswith(suffix)
    ]
    return stage


def test_the_gateway_health_check_asks_the_liveness_endpoint() -> None:
    check = exec_form(one(IMAGES["gateway"], "HEALTHCHECK"))
    assert "/healthz" in check[-1]
    assert "GATEWAY_PORT" in check[-1]
    # Against nothing listening, the probe fails (a live gateway is probed in
    # test_federation_render's end-to-end test).
    probe = subprocess.run(
        [sys.executable, *check[1:]],
        env={**os.environ, "GATEWAY_PORT": str(free_port())},
        capture_output=True,
        check=False,
        timeout=30,
    )
    assert probe.returncode != 0


@pytest.mark.slow
def test_the_site_health_check_asks_the_engines_grpc_health(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    check = exec_form(one(IMAGES["site"], "HEALTHCHECK"))
    assert check == ["python", "-m", "site_engine.healthcheck"]
    site = start_site(
        model_dir=tiny_llama_dir, site_name="probe", model_name="tiny", log_dir=tmp_path
    )
    # As in the container: the port comes from the engine's own settings.
    env = {**os.environ, "SITE_PORT": str(site.port), "SITE_MODEL_DIR": str(tiny_llama_dir)}
    command = [sys.executable, *check[1:]]
    try:
        alive = subprocess.run(command, env=env, capture_output=True, text=True, timeout=30)
        assert alive.returncode == 0, alive.stderr
    finally:
        site.stop()
    gone = subprocess.run(command, env=env, capture_output=True, text=True, timeout=30)
    assert gone.returncode == 1
    assert "unhealthy" in gone.stderr


def test_secrets_reach_the_gateway_under_names_something_reads(root: ModuleConfig) -> None:

    gateway = ModuleConfig.load(TERRAFORM_DIR / "modules" / "aws_gateway")
    rendered = render_root(root, tfvars(), addresses_for())
    evaluator = module_locals(gateway, module_inputs(root, rendered, "gateway"), keys=[])
    names = set(evaluator.local("secret_environment"))
    entrypoint = (DOCKER_DIR / "gateway-entrypoint.sh").read_text()
    settings = {v.name for v in variables(GatewaySettings)}
    for name in names:
        # GATEWAY_*: a setting; FEDLLM_*: the entrypoint; PGPASSWORD: libpq; HF_TOKEN: the hf CLI.
        assert name in settings or name in entrypoint or name in ("PGPASSWORD", "HF_TOKEN"), name
    assert "GATEWAY_ADMIN_TOKEN" in names


def test_the_load_balancer_keeps_every_operator_route_to_the_operators_networks(
    tmp_path: Path,
) -> None:

    gateway = ModuleConfig.load(TERRAFORM_DIR / "modules" / "aws_gateway")
    patterns = literal(gateway.locals["admin_paths"])
    app = create_app(GatewaySettings(federation_file=tmp_path / "unused.json"))
    guarded = {
        route.path
        for route in app.routes
        for handler in route.route_handlers  # type: ignore[union-attr]
        if require_admin in handler.resolve_guards()
    }
    # The operator surface's documented places, and every route the gateway guards today.
    for path in ("/admin", "/admin/api/keys", "/metrics", *guarded):
        assert any(fnmatch(path, p) for p in patterns), f"{path} would be reachable from anywhere"
    assert not any(fnmatch(path, p) for p in patterns for path in ("/v1/models", "/healthz"))
