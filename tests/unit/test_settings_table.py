"""The docs name only variables the settings read, and the gateway table of
docs/configuration.md is the one the fields render (regenerate it with
`python -m devtools.settings_table`)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from devtools.settings_table import BEGIN, END, PAGE, render, with_table
from fedllm_contract.env_settings import variables
from gateway.settings import GatewaySettings
from site_engine.settings import SiteSettings

REPO = PAGE.parents[1]


def test_the_gateway_table_is_generated_from_the_settings() -> None:
    text = PAGE.read_text()
    assert with_table(text, render(GatewaySettings)) == text, (
        "docs/configuration.md's gateway settings table is stale: "
        "run python -m devtools.settings_table"
    )


def test_every_gateway_variable_says_what_it_does() -> None:
    table = render(GatewaySettings)
    for variable in variables(GatewaySettings):
        assert variable.help, variable.name
        assert f"| `{variable.name}` |" in table


@pytest.mark.parametrize(
    "document", [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))], ids=lambda p: p.name
)
def test_every_variable_the_docs_name_is_read(document: Path) -> None:
    known = {v.name for v in variables(GatewaySettings)} | {v.name for v in variables(SiteSettings)}
    named = set(re.findall(r"`((?:GATEWAY|SITE)_[A-Z0-9_]*[A-Z0-9])`", document.read_text()))
    assert named <= known, sorted(named - known)


def test_a_page_without_the_markers_is_refused() -> None:
    with pytest.raises(ValueError, match="lacks the markers"):
        with_table("# no table here\n", "| a |")
    assert with_table(f"x\n{BEGIN}\nold\n{END}\ny", "new") == f"x\n{BEGIN}\n\nnew\n\n{END}\ny"
