"""The deployment as the tests see it: the root configuration evaluated against a .tfvars file.

What only a cloud knows (addresses, ARNs, certificates) is supplied as test doubles at the module
or resource boundary; everything the configuration computes from them (site names, the
federation file, container environments, boot scripts) is evaluated from the HCL itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lark import Tree

from tests.infra.hcl_eval import Evaluator, literal
from tests.infra.hcl_tree import (
    SPECIAL_ROOTS,
    TERRAFORM_DIR,
    HclError,
    ModuleConfig,
    parse_attributes,
    references,
)
from tests.infra.hcl_types import apply_type

Value = Any
EXAMPLE_TFVARS = TERRAFORM_DIR / "example.tfvars"
SITE_MODULES = {"aws_site": "aws", "gcp_site": "gcp", "azure_site": "azure"}

# Outputs of the modules that create cloud resources the sites and the gateway depend on.
INFRASTRUCTURE_OUTPUTS: dict[str, dict[str, Value]] = {
    "gateway_kms": {"arn": "arn:aws:kms:us-east-1:123456789012:key/test"},
    "gateway_network": {
        "vpc_id": "vpc-test",
        "public_subnet_ids": ["subnet-public-a", "subnet-public-b"],
        "private_subnet_ids": ["subnet-private-a", "subnet-private-b"],
        "egress_cidrs": ["198.51.100.10/32", "198.51.100.11/32"],
    },
    "pki": {
        "ca_cert_pem": "-----BEGIN CERTIFICATE-----\nCA\n-----END CERTIFICATE-----\n",
        "ca_private_key_pem": "-----BEGIN PRIVATE KEY-----\nCA\n-----END PRIVATE KEY-----\n",
        "gateway_cert_pem": "-----BEGIN CERTIFICATE-----\nGW\n-----END CERTIFICATE-----\n",
        "gateway_private_key_pem": "-----BEGIN PRIVATE KEY-----\nGW\n-----END PRIVATE KEY-----\n",
    },
}


def tfvars(path: Path = EXAMPLE_TFVARS) -> dict[str, Value]:
    return {name: literal(tree) for name, tree in parse_attributes(path).items()}


def variable_values(config: ModuleConfig, given: Mapping[str, Value]) -> dict[str, Value]:
    """Every variable of a module as Terraform would see it: given values or defaults, converted
    to the declared types. Unknown or missing required variables are errors."""
    unknown = sorted(set(given) - set(config.variables))
    if unknown:
        raise HclError(f"values for undeclared variables: {unknown}")
    values: dict[str, Value] = {}
    for name, block in config.variables.items():
        if name in given:
            raw = given[name]
        elif "default" in block.attributes:
            raw = literal(block.attributes["default"])
        else:
            raise HclError(f"variable {name!r} is required and has no value")
        values[name] = apply_type(block.attributes["type"], raw, f"var.{name}")
    return values


def validation_failures(config: ModuleConfig, values: Mapping[str, Value]) -> list[str]:
    """The error messages of every validation block whose condition does not hold."""
    evaluator = Evaluator(variables=values, directory=config.directory)
    failures: list[str] = []
    for block in config.variables.values():
        for validation in block.children("validation"):
            if evaluator.evaluate(validation.attributes["condition"]) is not True:
                failures.append(evaluator.evaluate(validation.attributes["error_message"]))
    return failures


def resource_doubles(
    trees: list[Tree], keys: list[str], overrides: Mapping[str, Value] | None = None
) -> dict[str, Value]:
    """Stand-ins for resource attributes the expressions read: `type.name[key].attr` becomes the
    string "<type.name.attr>" for every key, unless `overrides` gives `type.name.attr` a value."""
    doubles: dict[str, Any] = {}
    for tree in trees:
        for ref in references(tree):
            if ref.root in SPECIAL_ROOTS or len(ref.steps) < 2 or not isinstance(ref.steps[0], str):
                continue
            name, attribute = ref.steps[0], ref.steps[-1]
            dotted = f"{ref.root}.{name}.{attribute}"
            value = (overrides or {}).get(dotted, f"<{dotted}>")
            by_key = {key: {attribute: value} for key in keys}
            slot = doubles.setdefault(ref.root, {}).setdefault(name, {})
            if len(ref.steps) == 2:
                slot[attribute] = value
            else:
                for key, attrs in by_key.items():
                    slot.setdefault(key, {}).update(attrs)
    return doubles


def call_arguments(
    call: Mapping[str, Tree], evaluator: Evaluator, scope: Mapping[str, Value]
) -> dict[str, Value]:
    return {
        name: evaluator.evaluate(tree, scope)
        for name, tree in call.items()
        if name not in ("source", "for_each", "count", "depends_on", "providers", "version")
    }


SiteOutputs = Callable[[str, str, dict[str, Value]], dict[str, Value]]


@dataclass
class RenderedRoot:
    values: dict[str, Value]
    evaluator: Evaluator
    # Inputs each site module instance receives: (module call, site name) -> arguments.
    site_inputs: dict[tuple[str, str], dict[str, Value]] = field(default_factory=dict)

    def local(self, name: str) -> Value:
        return self.evaluator.local(name)


def render_root(
    root: ModuleConfig,
    given: Mapping[str, Value],
    site_outputs: SiteOutputs,
    infrastructure: Mapping[str, dict[str, Value]] | None = None,
) -> RenderedRoot:
    """Evaluates the root against variable values. Site modules' outputs come from
    `site_outputs(call, site, inputs)`, the only values not computed from the HCL; the other
    modules' from INFRASTRUCTURE_OUTPUTS, updated by `infrastructure` (e.g. real certificates)."""
    values = variable_values(root, given)
    modules: dict[str, Value] = {**INFRASTRUCTURE_OUTPUTS, **(infrastructure or {})}
    evaluator = Evaluator(
        variables=values, locals=root.locals, modules=modules, directory=root.directory
    )
    rendered = RenderedRoot(values, evaluator)
    for call_name in SITE_MODULES:
        call = root.module_calls[call_name]
        instances = evaluator.evaluate(call.attributes["for_each"])
        outputs: dict[str, Value] = {}
        for key in sorted(instances):
            scope = {"each": {"key": key, "value": instances[key]}}
            inputs = call_arguments(call.attributes, evaluator, scope)
            rendered.site_inputs[(call_name, key)] = inputs
            outputs[key] = site_outputs(call_name, key, inputs)
        modules[call_name] = outputs
    return rendered


def certificate_outputs(call: str, inputs: Mapping[str, Value]) -> dict[str, Value]:
    """A site module's outputs about its engines' certificates, evaluated from its HCL: the DNS
    names each engine's certificate request carries, through the module's own output expression
    (tls_server_names)."""
    module = ModuleConfig.load(TERRAFORM_DIR / "modules" / call)
    evaluator = Evaluator(
        variables=variable_values(module, inputs), locals=module.locals, directory=module.directory
    )
    request = module.resources[("tls_cert_request", "engine")].attributes
    requests = {
        key: {
            "dns_names": evaluator.evaluate(
                request["dns_names"], {"each": {"key": key, "value": value}}
            )
        }
        for key, value in evaluator.evaluate(request["for_each"]).items()
    }
    with_requests = Evaluator(
        variables=evaluator.variables,
        locals=module.locals,
        directory=module.directory,
        roots={"tls_cert_request": {"engine": requests}},
    )
    return {
        "tls_server_names": with_requests.evaluate(
            module.outputs["tls_server_names"].attributes["value"]
        )
    }


def addresses_for(base: str = "192.0.2") -> SiteOutputs:
    """Site outputs with documentation-range addresses, one per engine; the certificates' names
    come from the modules' HCL (certificate_outputs)."""
    counter = iter(range(1, 255))

    def outputs(call: str, site: str, inputs: dict[str, Value]) -> dict[str, Value]:
        ips = [f"{base}.{next(counter)}" for _ in inputs["instance_names"]]
        return {
            "public_ips": ips,
            "endpoints": [f"{ip}:{inputs['grpc_port']}" for ip in ips],
            "instance_ids": {name: f"id-{name}" for name in inputs["instance_names"]},
            **certificate_outputs(call, inputs),
        }

    return outputs


def module_inputs(root: ModuleConfig, rendered: RenderedRoot, call: str) -> dict[str, Value]:
    """The arguments a single-instance module call of the root receives."""
    return call_arguments(root.module_calls[call].attributes, rendered.evaluator, {})


def module_locals(
    module: ModuleConfig,
    inputs: Mapping[str, Value],
    overrides: Mapping[str, Value] | None = None,
    keys: list[str] | None = None,
) -> Evaluator:
    """An evaluator for a module's locals given its inputs; resource attributes are doubles."""
    roots = resource_doubles(list(module.locals.values()), keys or [], overrides)
    return Evaluator(
        variables=variable_values(module, inputs),
        locals=module.locals,
        directory=module.directory,
        roots=roots,
    )
