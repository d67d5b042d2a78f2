"""The README's commands as the Makefile spells them: every argument the Makefile passes must be
one the program accepts (a renamed flag once broke `make demo` with nothing else failing)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import tomllib
from pathlib import Path

import pytest

from devtools.demo import parse_args

REPO = Path(__file__).resolve().parents[2]


def make_dry_run(target: str, *variables: str, env: dict[str, str] | None = None) -> list[str]:
    """The commands `make -n TARGET` would run, its setup prerequisites assumed done."""
    out = subprocess.run(
        ["make", "-n", "-o", "setup", "-o", "setup-run", "-o", "lint", "-o", "infra-check",
         target, *variables],
        cwd=REPO, capture_output=True, text=True, check=True, timeout=60, env=env,
    )  # fmt: skip
    return out.stdout.splitlines()


def _demo_args(*variables: str, env: dict[str, str] | None = None) -> list[str]:
    lines = make_dry_run("demo", *variables, env=env)
    (line,) = [line for line in lines if "devtools.demo" in line]
    return shlex.split(line.split("devtools.demo", 1)[1])


def test_make_demo_passes_only_arguments_the_demo_accepts() -> None:
    # Without a setting the demo finds the datasets itself (built-in prompts where there are
    # none: issue 67); DATA_DIR or FEDLLM_DATA_DIR name them.
    bare = {k: v for k, v in os.environ.items() if k not in ("DATA_DIR", "FEDLLM_DATA_DIR")}
    assert parse_args(_demo_args(env=bare)).data_dir is None
    assert parse_args(_demo_args("DATA_DIR=/data/x", env=bare)).data_dir == Path("/data/x")
    named = {**bare, "FEDLLM_DATA_DIR": "/data/y"}
    assert parse_args(_demo_args(env=named)).data_dir == Path("/data/y")


def test_make_help_lists_every_target_a_newcomer_runs() -> None:
    # Run for real: it only reads the Makefile.
    out = subprocess.run(["make", "help"], cwd=REPO, capture_output=True, text=True, check=True)
    listed = {line.split()[0] for line in out.stdout.splitlines() if line.strip()}
    assert {"demo", "test", "setup", "setup-run", "clean", "help", "unit", "lint"} <= listed
    # The default goal: a bare `make` lists the targets (.ci/run names `make test`).
    bare = subprocess.run(["make"], cwd=REPO, capture_output=True, text=True, check=True)
    assert bare.stdout == out.stdout


def test_make_clean_removes_every_virtualenv_and_node_modules() -> None:
    (line,) = [line for line in make_dry_run("clean") if line.startswith("rm -rf")]
    removed = set(line.split()[2:])
    assert {".venv", ".venv-gateway", ".venv-checkov", "gateway/admin_ui/node_modules", "var"} <= (
        removed
    )


def test_the_demo_set_up_installs_the_sdk_the_readme_example_uses() -> None:
    dry = subprocess.run(
        ["make", "-n", "-B", "setup-run"], cwd=REPO, capture_output=True, text=True, check=True
    )
    (line,) = [line for line in dry.stdout.splitlines() if "pip install" in line and "-e '" in line]
    extras = line.split("-e '.[", 1)[1].split("]", 1)[0].split(",")
    optional = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert any(dep.startswith("openai") for extra in extras for dep in optional[extra])


@pytest.mark.parametrize("target", ["test", "test-serial"])
def test_make_test_runs_pytest_without_gpu_tests(target: str) -> None:
    lines = make_dry_run(target)
    assert any(re.search(r"-m pytest -m \"not gpu\"", line) for line in lines), lines
