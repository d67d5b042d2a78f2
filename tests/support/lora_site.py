"""One real site serving the tiny model with LoRA adapters from a folder, as the adapter tests
start it, and the federation file naming it."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from devtools.launch import ManagedProcess, spawn_site


def spawn_lora_site(
    model_dir: Path, work: Path, max_loras: int, site_name: str = "aws-use1", lora: str = "lora"
) -> ManagedProcess:
    """The site `site_name` serving `tiny` with the adapters under work/<lora> (rank <= 8)."""
    (work / lora).mkdir(exist_ok=True)
    args = ["--lora-dir", str(work / lora), "--max-loras", str(max_loras),
            "--max-lora-rank", "8"]  # fmt: skip
    return spawn_site(
        model_dir=model_dir, site_name=site_name, model_name="tiny", log_dir=work,
        extra_args=args,
    )  # fmt: skip


def write_federation(
    work: Path, model_dir: Path, site: ManagedProcess, adapters: Sequence[dict[str, Any]] = ()
) -> Path:
    """work/federation.json: the tiny model, that one site and the adapters section given."""
    document: dict[str, Any] = {
        "models": [{"name": "tiny", "tokenizer": str(model_dir)}],
        "sites": [{"name": "aws-use1", "cloud": "aws", "region": "us-east-1",
                   "endpoint": f"127.0.0.1:{site.port}", "model": "tiny"}],
    }  # fmt: skip
    if adapters:
        document["adapters"] = list(adapters)
    path = work / "federation.json"
    path.write_text(json.dumps(document))
    return path


def write_sites_federation(
    work: Path,
    model_dir: Path,
    sites: Mapping[str, ManagedProcess],
    adapters: Sequence[dict[str, Any]] = (),
) -> Path:
    """work/federation.json: the tiny model served by each named site (one cloud, one region),
    and the adapters section given."""
    document: dict[str, Any] = {
        "models": [{"name": "tiny", "tokenizer": str(model_dir)}],
        "sites": [{"name": name, "cloud": "aws", "region": "us-east-1",
                   "endpoint": f"127.0.0.1:{site.port}", "model": "tiny"}
                  for name, site in sites.items()],
    }  # fmt: skip
    if adapters:
        document["adapters"] = list(adapters)
    path = work / "federation.json"
    path.write_text(json.dumps(document))
    return path
