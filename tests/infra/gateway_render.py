"""The gateway's container as the AWS module renders it: its environment (the image's defaults
under the task definition's) and the secrets ECS injects from the gateway's bundle."""

from __future__ import annotations

import json

from tests.infra.containers import DOCKER_DIR, environment
from tests.infra.deployment import RenderedRoot, module_inputs, module_locals, resource_doubles
from tests.infra.hcl_eval import Evaluator
from tests.infra.hcl_tree import TERRAFORM_DIR, ModuleConfig


def gateway_container_env(root: ModuleConfig, rendered: RenderedRoot) -> dict[str, str]:
    gateway = ModuleConfig.load(TERRAFORM_DIR / "modules" / "aws_gateway")
    inputs = module_inputs(root, rendered, "gateway")
    evaluator = module_locals(
        gateway,
        inputs,
        overrides={
            "aws_db_instance.gateway.address": "fedllm.abc123.us-east-1.rds.amazonaws.com",
            "aws_db_instance.gateway.port": 5432,
        },
    )
    container: dict[str, str] = evaluator.local("environment")
    return {**environment(DOCKER_DIR / "gateway.Dockerfile"), **container}


def gateway_secrets(root: ModuleConfig, rendered: RenderedRoot) -> dict[str, str]:
    """What ECS injects from the gateway's secrets: each `secrets` entry of the container
    resolved against the JSON the module writes into the gateway's bundle."""
    gateway = ModuleConfig.load(TERRAFORM_DIR / "modules" / "aws_gateway")
    inputs = module_inputs(root, rendered, "gateway")
    evaluator = module_locals(gateway, inputs, keys=[])
    written = gateway.resources[("aws_secretsmanager_secret_version", "gateway")]
    tree = written.attributes["secret_string"]
    bundle = json.loads(
        Evaluator(
            variables=evaluator.variables,
            locals=gateway.locals,
            directory=gateway.directory,
            roots=resource_doubles([tree], []),
        ).evaluate(tree)
    )
    secrets: dict[str, str] = {}
    for name, value_from in evaluator.local("secret_environment").items():
        arn, key = value_from.rsplit(":", 3)[:2]
        if arn == "<aws_secretsmanager_secret.gateway.arn>":
            secrets[name] = bundle[key]
    return secrets
