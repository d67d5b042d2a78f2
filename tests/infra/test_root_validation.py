"""The root's variable validations, evaluated offline: the example passes them, and each kind of
mistake an operator can make in a site map is refused with the message written for it."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
from lark import Tree

from fedllm_contract.env_settings import variables
from gateway.settings import ROUTING_POLICIES, GatewaySettings
from site_engine.settings import SiteSettings
from tests.infra.deployment import tfvars, validation_failures, variable_values
from tests.infra.hcl_eval import literal
from tests.infra.hcl_tree import ModuleConfig, subtrees

Edit = Callable[[dict[str, Any]], None]


def test_the_example_sets_known_variables_and_passes_every_validation(root: ModuleConfig) -> None:
    values = variable_values(root, tfvars())
    assert validation_failures(root, values) == []


def _site(name: str, **changes: Any) -> Edit:
    def edit(values: dict[str, Any]) -> None:
        values["sites"][name].update(changes)

    return edit


def _drop_zone(values: dict[str, Any]) -> None:
    del values["sites"]["gcp-euw4"]["zone"]


def _colliding_names(values: dict[str, Any]) -> None:
    values["sites"]["aws-use1-1"] = dict(values["sites"]["aws-apne1"])


def _drain_all(values: dict[str, Any]) -> None:
    for site in values["sites"].values():
        site["drain"] = True


def _set(*path_and_value: Any) -> Edit:
    *path, value = path_and_value

    def edit(values: dict[str, Any]) -> None:
        *parents, last = path
        target = values
        for key in parents:
            target = target[key]
        target[last] = value

    return edit


MISTAKES: list[tuple[str, Edit, str]] = [
    ("unknown cloud", _site("gcp-euw4", cloud="oci"), "cloud must be aws, gcp or azure"),
    ("unknown model", _site("aws-use1", model="gpt-9"), "model must be one of the keys"),
    ("no engines", _site("aws-use1", count=0), "count must be a whole number"),
    ("half an engine", _site("aws-use1", count=1.5), "count must be a whole number"),
    ("zero weight", _site("aws-apne1", capacity_weight=0), "capacity_weight must be greater"),
    ("gcp without zone", _drop_zone, "zone is required on gcp"),
    ("zone elsewhere", _site("gcp-euw4", zone="us-central1-a"), "zone is required on gcp"),
    ("aws zone elsewhere", _site("aws-apne1", zone="us-east-1a"), "zone is required on gcp"),
    ("cpu instance", _site("aws-apne1", instance_type="m7i.large"), "instance_type must be"),
    (
        "type of another cloud",
        _site("azure-swc", instance_type="a2-highgpu-1g"),
        "instance_type must be",
    ),
    ("engine setting", _site("aws-use1", settings={"SITE_PORT": "1"}), "settings keys are engine"),
    (
        "multi-line setting",
        _site("aws-use1", settings={"SITE_DTYPE": "a\nb"}),
        "settings keys are engine",
    ),
    ("small disk", _site("aws-use1", disk_gb=20), "disk_gb must be between"),
    (
        "bad site name",
        lambda v: v["sites"].update({"AWS_east": v["sites"].pop("aws-apne1")}),
        "names are lowercase",
    ),
    ("engine name taken", _colliding_names, "two engines would get the same name"),
    ("unknown policy", _set("gateway", "routing_policy", "fastest"), "routing_policy must be"),
    (
        "managed setting",
        _set("gateway", "settings", {"GATEWAY_PORT": "1"}),
        "gateway.settings: GATEWAY_* names",
    ),
    ("predictor elsewhere", _set("gateway", "predictor_dir", "/tmp/p"), "predictor_dir must lie"),
    ("one zone", _set("gateway", "availability_zones", ["us-east-1a"]), "at least two zones"),
    ("admin from anywhere", _set("admin_cidrs", ["0.0.0.0/0"]), "admin_cidrs: 1 to 4"),
    ("gcp site, no project", _set("gcp_project", None), "gcp_project is required"),
    (
        "azure site, no subscription",
        _set("azure_subscription_id", None),
        "azure_subscription_id is required",
    ),
    (
        "repository without owner",
        _set("models", "qwen2.5-7b-instruct", "hf_repo", "qwen"),
        "hf_repo is 'owner/name'",
    ),
    ("image without tag", _set("site_image", "fedllm-site"), "site_image must be"),
    ("not a token", _set("hf_token", "password"), "hf_token must be"),
    ("old postgres", _set("database", {"engine_version": "13"}), "PostgreSQL 15 or later"),
    ("no sites", _set("sites", {}), "sites: at least one"),
    ("all draining", lambda v: _drain_all(v), "at least one site must not be draining"),
]


@pytest.mark.parametrize(("mistake", "edit", "message"), MISTAKES, ids=[m[0] for m in MISTAKES])
def test_each_mistake_is_refused_with_its_message(
    root: ModuleConfig, mistake: str, edit: Edit, message: str
) -> None:
    given = copy.deepcopy(tfvars())
    edit(given)
    failures = validation_failures(root, variable_values(root, given))
    # A wrong cloud also fails the checks that depend on the cloud (instance type, zone).
    assert any(message in failure for failure in failures), failures


def _string_lists(tree: Tree) -> list[list[str]]:
    found = []
    for node in tree.iter_subtrees():
        if node.data == "tuple" and subtrees(node):
            try:
                items = [literal(item) for item in subtrees(node)]
            except Exception:
                continue
            if all(isinstance(item, str) for item in items):
                found.append(items)
    return found


def _validation_lists(root: ModuleConfig, variable: str) -> list[list[str]]:
    return [
        items
        for validation in root.variables[variable].children("validation")
        for items in _string_lists(validation.attributes["condition"])
    ]


def test_the_routing_policies_allowed_are_the_gateways(root: ModuleConfig) -> None:
    lists = [items for items in _validation_lists(root, "gateway") if "mico" in items]
    assert [sorted(items) for items in lists] == [sorted(ROUTING_POLICIES)]


def test_the_settings_names_allowed_are_real_settings_the_deployment_leaves_open(
    root: ModuleConfig,
) -> None:
    site_names = {v.name for v in variables(SiteSettings)}
    allowed = next(items for items in _validation_lists(root, "sites") if "SITE_DTYPE" in items)
    assert set(allowed) <= site_names
    # Set by the site modules or the image: names, model, listen address.
    assert not set(allowed) & {
        "SITE_SITE_NAME",
        "SITE_MODEL_NAME",
        "SITE_MODEL_DIR",
        "SITE_HOST",
        "SITE_PORT",
        "SITE_TLS_CERT",
        "SITE_TLS_KEY",
        "SITE_TLS_CLIENT_CA",
    }
    gateway_names = {v.name for v in variables(GatewaySettings)}
    reserved = next(i for i in _validation_lists(root, "gateway") if "GATEWAY_DATABASE_URL" in i)
    assert set(reserved) <= gateway_names
    # The entrypoint names the TLS files it writes from the gateway's secret bundle.
    assert {"GATEWAY_SITE_TLS_CA", "GATEWAY_SITE_TLS_CERT", "GATEWAY_SITE_TLS_KEY"} <= set(reserved)
