"""The README stays short and true (issue 48, a newcomer's first hour): its curl example is the
command the demo prints, its deployment recipe's federation file is one the gateway accepts and
names the sites its commands start, and it keeps to the two set-up commands.

The examples themselves run against a real federation in tests/e2e/test_real_model_http.py."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

from devtools.demo_report import try_it_command
from devtools.demo_send import MODEL_NAME
from gateway.federation import parse_federation
from site_engine.__main__ import parse_args as site_args
from tests.support.readme import README, block, blocks, curl_example, sdk_example

MAX_LINES = 250


def test_the_readme_is_short() -> None:
    lines = README.read_text().count("\n")
    assert lines <= MAX_LINES, f"README.md has {lines} lines: move detail into docs/"


def test_the_readme_keeps_exactly_the_two_setup_commands() -> None:
    commands = [
        line.split("#", 1)[0].strip()
        for line in block("sh", "make demo").splitlines()
        if line.split("#", 1)[0].strip()
    ]
    assert commands == ["make demo", "make test"]
    # Each sets itself up: no other set-up step to follow before the API is tried (deploying
    # on GPUs, further down, installs a CUDA torch).
    text = README.read_text().split("## Deploy on one host")[0]
    for step in ("make setup", "pip install", "npm ci", "npm install", "apt-get", "venv"):
        assert f"{step} " not in text, step
        assert f"`{step}`" not in text, step


def test_the_curl_example_is_the_command_the_demo_prints() -> None:
    assert curl_example() == try_it_command("http://127.0.0.1:PORT", MODEL_NAME)


def test_the_sdk_example_calls_the_demos_model_on_the_printed_port() -> None:
    example = sdk_example()
    compile(example, "README.md", "exec")
    assert 'base_url="http://127.0.0.1:PORT/v1"' in example
    assert f'model="{MODEL_NAME}"' in example


def _started_sites(recipe: str) -> list[list[str]]:
    """The `python -m site_engine` arguments the recipe's loop runs, as bash expands them."""
    loop = recipe[recipe.index("for gpu") : recipe.index("done") + len("done")]
    echoed = re.sub(r"CUDA_VISIBLE_DEVICES=\$gpu \S+ -m site_engine", "echo", loop)
    out = subprocess.run(
        ["bash", "-c", echoed.replace(" &\n", "\n")], capture_output=True, text=True, check=True
    )
    return [shlex.split(line) for line in out.stdout.splitlines()]


def test_the_deployment_recipe_starts_the_sites_its_federation_file_names(tmp_path: Path) -> None:
    (federation_text,) = blocks("json", '"sites"')
    federation = parse_federation(federation_text.encode(), tmp_path)
    recipe = block("sh", "-m site_engine")
    sites = [site_args(argv) for argv in _started_sites(recipe)]
    assert [(s.site_name, f"127.0.0.1:{s.port}", s.model_name) for s in sites] == [
        (site.name, site.endpoint, site.model) for site in federation.sites
    ]
    assert all(site.host == "127.0.0.1" for site in sites)  # loopback: plaintext allowed
    # The key the recipe makes is a valid admin API body.
    body = re.search(r"-d '(\{[^']*\})'", recipe[recipe.index("/admin/api/keys") :])
    assert body is not None
    assert set(json.loads(body.group(1))) <= {
        "name", "requests_per_minute", "tokens_per_minute", "max_concurrent_requests",
    }  # fmt: skip


def test_the_ci_figures_are_kept_in_the_readme_alone() -> None:
    """How long `.ci/run` takes and how many tests it runs: stated once (issue 67: the
    development guide kept an older pair)."""
    figure = re.compile(r"\d[\d,]* tests|\d+(\.\d+)? min(utes)?\b")
    assert re.search(r"`\.ci/run` \(set-up, lint\s+and [\d,]+ tests", README.read_text())
    for doc in (README.parent / "docs").glob("*.md"):
        for line in doc.read_text().splitlines():
            if ".ci/run" in line:
                assert not figure.search(line), f"{doc.name}: {line}"
