"""One real site serving the tiny model with LoRA adapters from a folder, as the adapter tests
start it, and the federation file naming it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from devtools.launch import ManagedProcess, spawn_site


def spawn_lora_site(model_dir: Path, work: Path, max_loras: int) -> ManagedProcess:
    """The site `aws-use1` serving `tiny` with the adapters under work/lora (rank <= 8)."""
    (work / "lora").mkdir(exist_ok=True)
    args = ["--lora-dir", str(work / "lora"), "--max-loras", str(max_loras),
            "--max-lora-rank", "8"]  # fmt: skip
    return spawn_site(
        model_dir=model_dir, site_name="aws-use1", model_name="tiny", log_dir=work,
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
