"""The README's fenced code blocks, as the tests run them: its examples are commands a newcomer
pastes, so the tests take them from the README itself rather than from a copy that could drift."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
# The README's placeholder for the port the demo prints.
PORT = "PORT"


def blocks(language: str, containing: str) -> list[str]:
    """The README's blocks fenced as `language` whose text contains `containing`."""
    return [
        body
        for lang, body in FENCE.findall(README.read_text())
        if lang == language and containing in body
    ]


def block(language: str, containing: str) -> str:
    """The one README block fenced as `language` that contains `containing`."""
    found = blocks(language, containing)
    if len(found) != 1:
        raise AssertionError(
            f"README.md has {len(found)} {language!r} blocks containing {containing!r}, not one"
        )
    return found[0]


def curl_example() -> str:
    return block("sh", "curl -s http://127.0.0.1:PORT/v1/chat/completions").rstrip("\n")


def sdk_example() -> str:
    return block("python", "from openai import OpenAI")


def with_port(example: str, port: int) -> str:
    """The example as pasted by someone whose gateway listens on `port`."""
    assert f"127.0.0.1:{PORT}" in example, example
    return example.replace(f"127.0.0.1:{PORT}", f"127.0.0.1:{port}")
