"""What the gateway's container image installs, before and after the contract package split it
from the site engine (docs/architecture.md).

No docker engine runs here, so the image's Python payload is computed from what it installs: the
distributions its `pip install` resolves (the closure of pyproject.toml's requirements, walked
through the metadata of this virtualenv, which holds the same pinned wheels, torch from the CPU
index as the image takes it) and the source folders it copies. Sizes are the bytes of each
distribution's installed files. The base image (python:3.11-slim) is the same in both and left
out.

    python -m bench.image_size      # writes bench/results/image_size/gateway_image_size.{json,md}
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from bench.common import results_dir

REPO = Path(__file__).resolve().parents[1]
RESULTS = results_dir("image_size")
MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class ImageSet:
    name: str
    extras: tuple[str, ...]
    sources: tuple[str, ...]


# Before: every dependency was a core one (torch, training and GGUF loading included) and the
# image copied site_engine. After: the core dependencies and the packages the gateway runs.
BEFORE = ImageSet(
    "before", ("site", "train"), ("gateway", "site_engine", "predictor", "migrations")
)
AFTER = ImageSet("after", (), ("fedllm_contract", "gateway", "predictor", "migrations"))


def _installed_bytes(dist: metadata.Distribution) -> int:
    total = 0
    for file in dist.files or ():
        path = Path(str(file.locate()))
        if path.is_file():
            total += path.stat().st_size
    return total


def closure(requirements: list[str], extras: tuple[str, ...]) -> dict[str, int]:
    """Installed bytes of every distribution the requirements pull in, by name."""
    sizes: dict[str, int] = {}
    pending: list[tuple[Requirement, tuple[str, ...]]] = [
        (Requirement(r), ()) for r in requirements
    ]
    pending += [(Requirement(f"fedllm[{extra}]"), (extra,)) for extra in extras]
    while pending:
        requirement, wanted = pending.pop()
        name = canonicalize_name(requirement.name)
        if name == "fedllm":  # the project itself: only the extras' requirements count
            for extra in wanted:
                pending += [(Requirement(r), ()) for r in _extra(extra)]
            continue
        if name in sizes:
            continue
        dist = metadata.distribution(name)
        sizes[name] = _installed_bytes(dist)
        for raw in dist.requires or ():
            child = Requirement(raw)
            if child.marker is None or any(
                child.marker.evaluate({"extra": extra}) for extra in ("", *requirement.extras)
            ):
                pending.append((child, ()))
    return sizes


def _pyproject() -> dict[str, object]:
    project: dict[str, object] = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return project


def _extra(name: str) -> list[str]:
    extras: dict[str, list[str]] = _pyproject()["optional-dependencies"]  # type: ignore[assignment]
    return extras[name]


def source_bytes(folder: str) -> int:
    return sum(
        path.stat().st_size
        for path in (REPO / folder).rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    )


def measure(image: ImageSet) -> dict[str, object]:
    core: list[str] = _pyproject()["dependencies"]  # type: ignore[assignment]
    packages = closure(core, image.extras)
    sources = {folder: source_bytes(folder) for folder in image.sources}
    return {
        "image": image.name,
        "distributions": len(packages),
        "packages_mib": round(sum(packages.values()) / MIB, 1),
        "sources_mib": round(sum(sources.values()) / MIB, 1),
        "total_mib": round((sum(packages.values()) + sum(sources.values())) / MIB, 1),
        "torch": "torch" in packages,
        "largest": {
            name: round(size / MIB, 1)
            for name, size in sorted(packages.items(), key=lambda kv: -kv[1])[:8]
        },
        "sources": {folder: round(size / MIB, 2) for folder, size in sources.items()},
    }


def main() -> None:
    rows = [measure(BEFORE), measure(AFTER)]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "gateway_image_size.json").write_text(json.dumps(rows, indent=2) + "\n")
    lines = [
        "# Gateway image: installed Python payload (python -m bench.image_size)",
        "",
        "| image | distributions | packages MiB | sources MiB | total MiB | torch | largest |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    for row in rows:
        largest = ", ".join(f"{n} {s}" for n, s in list(row["largest"].items())[:4])  # type: ignore[attr-defined]
        lines.append(
            f"| {row['image']} | {row['distributions']} | {row['packages_mib']} | "
            f"{row['sources_mib']} | {row['total_mib']} | {row['torch']} | {largest} |"
        )
    ratio = rows[1]["total_mib"] / rows[0]["total_mib"]  # type: ignore[operator]
    lines += ["", f"after / before: {ratio:.2f}"]
    (RESULTS / "gateway_image_size.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
