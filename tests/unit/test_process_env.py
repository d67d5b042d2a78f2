"""The environment the gateway package sets for the libraries it loads (gateway/__init__.py):
its defaults when the operator set nothing, the operator's values otherwise."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _after_import(name: str, value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != name}
    if value is not None:
        env[name] = value
    code = f"import os, gateway; print(os.environ[{name!r}])"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


@pytest.mark.parametrize(
    ("name", "operator_value", "seen"),
    [
        ("GRPC_EXPERIMENTS", None, "-event_engine_client"),
        ("GRPC_EXPERIMENTS", "event_engine_client", "event_engine_client"),
        ("ORT_DISABLE_TELEMETRY", None, "1"),
        ("ORT_DISABLE_TELEMETRY", "0", "0"),
    ],
)
def test_defaults_apply_only_where_the_operator_set_nothing(
    name: str, operator_value: str | None, seen: str
) -> None:
    assert _after_import(name, operator_value) == seen
