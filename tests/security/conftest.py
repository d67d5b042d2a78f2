"""Fixtures of the attack tests: real processes from tests/e2e, parsed Terraform from
tests/infra."""

from tests.e2e.conftest import start_federation
from tests.infra.conftest import configs, root

__all__ = ["configs", "root", "start_federation"]
