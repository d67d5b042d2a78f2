"""The README's commands as the Makefile spells them: every argument the Makefile passes must be
one the program accepts (a renamed flag once broke `make demo` with nothing else failing)."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from devtools.demo import parse_args

REPO = Path(__file__).resolve().parents[2]


def make_dry_run(target: str) -> list[str]:
    """The commands `make -n TARGET` would run, its setup prerequisites assumed done."""
    out = subprocess.run(
        ["make", "-n", "-o", "setup", "-o", "lint", "-o", "infra-check", target],
        cwd=REPO, capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    return out.stdout.splitlines()


def test_make_demo_passes_only_arguments_the_demo_accepts() -> None:
    (line,) = [line for line in make_dry_run("demo") if "devtools.demo" in line]
    arguments = shlex.split(line.split("devtools.demo", 1)[1])
    args = parse_args(arguments)
    assert args.data_dir == Path("../shared/datasets")


@pytest.mark.parametrize("target", ["test", "test-serial"])
def test_make_test_runs_pytest_without_gpu_tests(target: str) -> None:
    lines = make_dry_run(target)
    assert any(re.search(r"-m pytest -m \"not gpu\"", line) for line in lines), lines
