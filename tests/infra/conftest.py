"""Fixtures of the offline Terraform checks: every configuration directory, parsed once."""

from __future__ import annotations

import pytest

from tests.infra.hcl_tree import TERRAFORM_DIR, ModuleConfig
from tests.infra.wiring import load_tree


def configuration_dirs() -> list[str]:
    """'.' for the root, 'modules/<name>' for each module: parametrize ids."""
    modules = sorted(p.name for p in (TERRAFORM_DIR / "modules").iterdir() if p.is_dir())
    return [".", *(f"modules/{name}" for name in modules)]


@pytest.fixture(scope="session")
def configs() -> dict[str, ModuleConfig]:
    """The root and every module, by path relative to infra/terraform."""
    return load_tree(TERRAFORM_DIR)


@pytest.fixture(scope="session")
def root(configs: dict[str, ModuleConfig]) -> ModuleConfig:
    return configs["."]
