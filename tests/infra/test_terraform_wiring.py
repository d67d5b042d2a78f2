"""What `terraform validate` would catch, checked offline: every reference resolves, every module
call passes exactly the variables the module declares, every template gets exactly its inputs.
Each check is first shown to catch a planted mistake, then run on the real configuration."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from tests.infra.conftest import configuration_dirs
from tests.infra.hcl_tree import TERRAFORM_DIR, ModuleConfig
from tests.infra.wiring import (
    declaration_problems,
    load_tree,
    module_call_problems,
    output_problems,
    resource_problems,
    template_problems,
)


@pytest.mark.parametrize("path", configuration_dirs())
def test_no_configuration_has_a_wiring_problem(configs: dict[str, ModuleConfig], path: str) -> None:
    config = configs[path]
    problems = [
        *declaration_problems(config, "var"),
        *declaration_problems(config, "local"),
        *module_call_problems(config, configs),
        *output_problems(config, configs),
        *resource_problems(config),
        *template_problems(config)[1],
    ]
    assert problems == []


def test_the_boot_template_is_checked(configs: dict[str, ModuleConfig]) -> None:
    seen, problems = template_problems(configs["modules/site_boot"])
    assert (seen, problems) == (1, [])


def test_the_boot_template_leaves_the_shells_expansions_to_the_shell() -> None:
    # In a template "${x}" is Terraform's; the shell's own ${...} must be written $${...}.
    template = TERRAFORM_DIR / "modules" / "site_boot" / "boot.sh.tftpl"
    names = set(re.findall(r"(?<!\$)\$\{([^}]*)\}", template.read_text()))
    assert names == {
        "instance_name",
        "image",
        "grpc_port",
        "env_lines",
        "fetch_bundle",
        "tls_dir",
        "tls_files",
    }


# ---- each check catches the mistake it exists for --------------------------------------------

ROOT_TF = """
variable "region" {
  description = "where it runs"
  type        = string
}
variable "spare" {
  description = "never used anywhere"
  type        = string
}
locals {
  name = "x-${var.region}"
}
module "net" {
  source = "./modules/net"
  cidr   = "10.0.0.0/16"
  colour = "blue"
}
resource "thing" "a" {
  label = "${local.nme}-${module.net.vpc_idd}"
  other = [for n, m in module.net : m.nothing]
  zone  = var.zone
  peer  = thing.b.id
  look  = data.source.missing.id
  tmpl  = templatefile("${path.module}/t.tftpl", { region = var.region })
}
"""
MODULE_TF = """
variable "cidr" {
  description = "the network's range"
  type        = string
}
variable "name" {
  description = "the network's name"
  type        = string
}
output "vpc_id" {
  description = "the network's id"
  value       = "${var.name}-${var.cidr}"
}
"""


@pytest.fixture(scope="module")
def broken(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ModuleConfig]:
    root = tmp_path_factory.mktemp("broken")
    (root / "modules" / "net").mkdir(parents=True)
    (root / "main.tf").write_text(ROOT_TF)
    (root / "t.tftpl").write_text("${region} ${zone}\n")
    (root / "modules" / "net" / "main.tf").write_text(MODULE_TF)
    return load_tree(root)


def test_undeclared_and_unused_names_are_found(broken: dict[str, ModuleConfig]) -> None:
    assert declaration_problems(broken["."], "var") == [
        "var.zone is used but not declared",
        "var.spare is declared but never used",
    ]
    assert declaration_problems(broken["."], "local") == [
        "local.nme is used but not declared",
        "local.name is declared but never used",
    ]


def test_module_calls_with_unknown_or_missing_variables_are_found(
    broken: dict[str, ModuleConfig],
) -> None:
    assert module_call_problems(broken["."], broken) == [
        "module net: passes 'colour', which the module does not declare",
        "module net: does not pass the required variable 'name'",
    ]


def test_missing_outputs_are_found_directly_and_through_loops(
    broken: dict[str, ModuleConfig],
) -> None:
    problems = output_problems(broken["."], broken)
    assert len(problems) == 2
    assert "module net has no output 'vpc_idd'" in problems[0]
    assert "module net has no output 'nothing'" in problems[1]


def test_undeclared_resources_and_data_sources_are_found(broken: dict[str, ModuleConfig]) -> None:
    problems = resource_problems(broken["."])
    assert [p.rsplit(": ", 1)[1] for p in problems] == [
        "no resource thing.b",
        "no data source source.missing",
    ]


def test_template_inputs_must_match_what_the_template_uses(broken: dict[str, ModuleConfig]) -> None:
    seen, problems = template_problems(broken["."])
    assert seen == 1
    assert problems[0].endswith("template uses ['region', 'zone'], gets ['region']")


def test_the_real_tree_loads_the_same_way(tmp_path: Path) -> None:
    copy = tmp_path / "terraform"
    shutil.copytree(TERRAFORM_DIR, copy)
    configs = load_tree(copy)
    assert set(configs) == set(configuration_dirs())
    assert module_call_problems(configs["."], configs) == []
