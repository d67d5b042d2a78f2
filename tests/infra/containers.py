"""What the container images define: their Dockerfile instructions, read without Docker."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

DOCKER_DIR = Path(__file__).resolve().parents[2] / "docker"


@dataclass(frozen=True)
class Instruction:
    keyword: str
    arguments: str
    stage: int  # 0 for the first FROM's stage, 1 for the second, ...


def instructions(dockerfile: Path) -> list[Instruction]:
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    found: list[Instruction] = []
    stage = -1
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, arguments = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stage += 1
        found.append(Instruction(keyword, arguments.strip(), stage))
    return found


def final_stage(dockerfile: Path) -> list[Instruction]:
    everything = instructions(dockerfile)
    last = max(i.stage for i in everything)
    return [i for i in everything if i.stage == last]


def environment(dockerfile: Path) -> dict[str, str]:
    """The ENV of the image that runs (its final stage)."""
    env: dict[str, str] = {}
    for instruction in final_stage(dockerfile):
        if instruction.keyword == "ENV":
            for pair in shlex.split(instruction.arguments):
                key, _, value = pair.partition("=")
                env[key] = value
    return env


def exec_form(instruction: Instruction) -> list[str]:
    """The JSON array of a CMD, ENTRYPOINT or HEALTHCHECK ... CMD instruction."""
    arguments = instruction.arguments
    if instruction.keyword == "HEALTHCHECK":
        arguments = arguments[arguments.index("CMD") + 3 :]
    parsed = json.loads(arguments)
    assert isinstance(parsed, list)
    assert all(isinstance(p, str) for p in parsed)
    return parsed


def one(dockerfile: Path, keyword: str) -> Instruction:
    matches = [i for i in final_stage(dockerfile) if i.keyword == keyword]
    assert len(matches) == 1, f"{dockerfile.name}: expected one {keyword}, found {len(matches)}"
    return matches[0]
