"""One routing default everywhere a deployment or a newcomer meets it: the gateway settings'
default, the Kubernetes manifest, Terraform's variable and example, the README's quickstart, the
demo and the docs that name it (issue 61: the default was once stated three ways)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from gateway.settings import RoutingSettings

ROOT = Path(__file__).resolve().parents[3]
DEFAULT = RoutingSettings().policy


def _one(pattern: str, path: str) -> str:
    found = re.findall(pattern, (ROOT / path).read_text())
    assert len(found) == 1, f"{path}: expected one match of {pattern!r}, found {found}"
    return str(found[0])


def test_the_kubernetes_gateway_runs_the_settings_default() -> None:
    docs: list[Any] = list(yaml.safe_load_all((ROOT / "deploy/k8s/base/gateway.yaml").read_text()))
    env = [
        e
        for d in docs
        if d and d.get("kind") == "Deployment"
        for c in d["spec"]["template"]["spec"]["containers"]
        for e in c.get("env", [])
        if e["name"] == "GATEWAY_ROUTING_POLICY"
    ]
    assert [e["value"] for e in env] == [DEFAULT]


def test_terraform_defaults_to_the_settings_default_and_its_example_runs_it() -> None:
    variables = "infra/terraform/variables.tf"
    assert _one(r'routing_policy\s*=\s*optional\(string,\s*"(\w+)"\)', variables) == DEFAULT
    assert _one(r"\(default (\w+), the gateway's", variables) == DEFAULT
    assert _one(r'routing_policy\s*=\s*"(\w+)"', "infra/terraform/example.tfvars") == DEFAULT


def test_the_readme_demo_and_docs_name_the_settings_default() -> None:
    assert _one(r"GATEWAY_ROUTING_POLICY=(\w+)", "README.md") == DEFAULT
    assert _one(r"routing `(\w+)`, the default,", "README.md") == DEFAULT  # make demo's line
    assert _one(r"`routing_policy` \(default `(\w+)`", "docs/deploy.md") == DEFAULT
    assert _one(r"behind a gateway routing with `(\w+)`", "docs/development.md") == DEFAULT
    assert _one(r"routing by the gateway's default policy \(`(\w+)`", "devtools/demo.py") == DEFAULT
    # The demo passes the settings' default, not a name of its own.
    assert "RoutingSettings().policy" in (ROOT / "devtools/demo.py").read_text()
    routing = (ROOT / "docs/routing.md").read_text()
    row = next(line for line in routing.splitlines() if "**The default**" in line)
    assert row.startswith(f"| `{DEFAULT}` |")
    assert _one(r"The default routing policy is `(\w+)`", "docs/routing.md") == DEFAULT
