"""Every Terraform file parses, is documented, and pins what it depends on."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import hcl2
import pytest

from tests.infra.conftest import configuration_dirs
from tests.infra.hcl_eval import literal
from tests.infra.hcl_tree import TERRAFORM_DIR, ModuleConfig

TF_FILES = sorted(TERRAFORM_DIR.rglob("*.tf")) + sorted(TERRAFORM_DIR.rglob("*.tfvars"))
REPO = TERRAFORM_DIR.parents[1]
SKIP = re.compile(r"#\s*checkov:skip=([A-Z0-9_]+)(?::(.*))?")


@pytest.mark.parametrize("path", TF_FILES, ids=lambda p: str(p.relative_to(TERRAFORM_DIR)))
def test_every_file_parses_with_python_hcl2(path: Path) -> None:
    with path.open() as handle:
        parsed = hcl2.load(handle)
    assert parsed, f"{path} is empty"


def test_the_tree_holds_a_root_and_the_modules_the_design_names() -> None:
    assert set(configuration_dirs()) >= {
        ".",
        "modules/aws_gateway",
        "modules/aws_network",
        "modules/aws_site",
        "modules/gcp_site",
        "modules/azure_site",
        "modules/pki",
    }


@pytest.mark.parametrize("path", configuration_dirs())
def test_variables_and_outputs_are_documented(configs: dict[str, ModuleConfig], path: str) -> None:
    config = configs[path]
    for kind, blocks in (("variable", config.variables), ("output", config.outputs)):
        for name, block in blocks.items():
            assert "description" in block.attributes, f"{path}: {kind} {name} has no description"
            description = literal(block.attributes["description"])
            assert len(description.split()) >= 3, f"{path}: {kind} {name}: {description!r}"
    for name, block in config.variables.items():
        assert "type" in block.attributes, f"{path}: variable {name} has no type"


def test_every_root_variable_is_validated(root: ModuleConfig) -> None:
    # The root is what operators fill in; its validations guard every module below it.
    unvalidated = {
        name for name, block in root.variables.items() if not block.children("validation")
    }
    assert unvalidated == set()


def _required_providers(config: ModuleConfig) -> dict[str, dict[str, str]]:
    found: dict[str, dict[str, str]] = {}
    for block in config.blocks:
        if block.type == "terraform":
            for required in block.children("required_providers"):
                found.update({k: literal(v) for k, v in required.attributes.items()})
    return found


@pytest.mark.parametrize("path", configuration_dirs())
def test_every_provider_used_is_required_with_a_version(
    configs: dict[str, ModuleConfig], path: str
) -> None:
    config = configs[path]
    used = {t.split("_")[0] for t, _ in [*config.resources, *config.data_sources]}
    required = _required_providers(config)
    assert used <= set(required), f"{path}: providers used but not required: {used - set(required)}"
    for name, spec in required.items():
        assert spec["source"] == f"hashicorp/{name}"
        assert spec["version"], f"{path}: provider {name} has no version constraint"
    terraform = [b for b in config.blocks if b.type == "terraform"]
    assert terraform
    assert "required_version" in terraform[0].attributes


def test_the_root_pins_every_provider_to_a_minor_series(root: ModuleConfig) -> None:
    required = _required_providers(root)
    assert set(required) == {"aws", "google", "azurerm", "random", "tls"}
    for name, spec in required.items():
        assert re.fullmatch(r"~> \d+\.\d+", spec["version"]), f"{name}: {spec['version']}"


def _skips() -> list[tuple[str, int, str, str]]:
    found = []
    for path in [*TERRAFORM_DIR.rglob("*.tf"), *(REPO / "docker").glob("*Dockerfile*")]:
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            match = SKIP.search(line)
            if match:
                found.append((str(path.relative_to(REPO)), number, match[1], match[2] or ""))
    return found


def test_every_checkov_skip_says_why() -> None:
    skips = _skips()
    assert skips, "the skip scan found nothing: the pattern or the paths are wrong"
    vague = [(f, n, check) for f, n, check, reason in skips if len(reason.split()) < 10]
    assert vague == [], "checkov skips need a reason of a sentence or more"


def test_the_security_scan_is_part_of_make_test() -> None:
    # What `make test` would run (a dry run: make prints the commands, runs none of them).
    planned = subprocess.run(
        ["make", "-n", "test"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    scans = [line for line in planned.splitlines() if "checkov --quiet" in line]
    assert {"--framework terraform", "--framework dockerfile"} <= {
        framework for line in scans for framework in re.findall(r"--framework \w+", line)
    }
    makefile = (REPO / "Makefile").read_text()
    assert "infra/checkov-requirements.txt" in makefile
    pins = (REPO / "infra" / "checkov-requirements.txt").read_text().splitlines()
    assert "checkov==3.3.30" in pins
    assert all("==" in p for p in pins if p and not p.startswith("#"))
