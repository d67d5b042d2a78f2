"""Sites are never open to the world: every inbound rule of every site module admits only the
gateway's egress addresses, which the root wires from the gateway network's NAT gateways."""

from __future__ import annotations

import pytest

from tests.infra.deployment import SITE_MODULES, validation_failures
from tests.infra.hcl_eval import literal
from tests.infra.hcl_tree import Block, ModuleConfig, Reference, references

# Resource types that let traffic in, and the attribute naming where it may come from.
INBOUND = {
    "aws_vpc_security_group_ingress_rule": "cidr_ipv4",
    "google_compute_firewall": "source_ranges",
    "azurerm_network_security_rule": "source_address_prefixes",
}


def _is_inbound(block: Block) -> bool:
    if block.labels[0] == "google_compute_firewall":
        return bool(literal(block.attributes["direction"]) == "INGRESS")
    if block.labels[0] == "azurerm_network_security_rule":
        return bool(literal(block.attributes["direction"]) == "Inbound")
    return block.labels[0] == "aws_vpc_security_group_ingress_rule"


@pytest.mark.parametrize("module", sorted(SITE_MODULES))
def test_every_inbound_rule_of_a_site_admits_only_the_gateway(
    configs: dict[str, ModuleConfig], module: str
) -> None:
    config = configs[f"modules/{module}"]
    inbound = [b for b in config.blocks if b.type == "resource" and _is_inbound(b)]
    assert inbound, f"{module}: no inbound rule found, so nothing was checked"
    for block in inbound:
        source = block.attributes[INBOUND[block.labels[0]]]
        assert set(references(source)) <= {
            Reference("var", ("gateway_cidrs",)),
            Reference("var", ("gateway_cidrs", None)),
            Reference("count", ("index",)),
        }, f"{module}: {'.'.join(block.labels)} admits more than the gateway"
        assert Reference("var", ("gateway_cidrs",)) in {
            Reference(r.root, r.steps[:1]) for r in references(source)
        }
    # No inline ingress blocks or other ways in (SSH, RDP) besides those rules.
    for block in config.blocks:
        assert not block.children("ingress"), f"{module}: inline ingress in {block.labels}"


def test_the_root_gives_every_site_the_gateway_nat_addresses(root: ModuleConfig) -> None:
    for module in SITE_MODULES:
        source = root.module_calls[module].attributes["gateway_cidrs"]
        assert list(references(source)) == [
            Reference("module", ("gateway_network", "egress_cidrs"))
        ]


def test_a_site_refuses_the_whole_internet_as_its_gateway(configs: dict[str, ModuleConfig]) -> None:
    for module in SITE_MODULES:
        config = configs[f"modules/{module}"]
        only = {"gateway_cidrs": ["0.0.0.0/0"]}
        failures = validation_failures(
            ModuleConfig(config.directory, [config.variables["gateway_cidrs"]]), only
        )
        assert failures == ["gateway_cidrs: at least one CIDR, never 0.0.0.0/0."]
