"""A real site serving the tiny model that takes fine-tuning jobs (its reserve > 0), and the
federation file naming it, as the gateway's fine-tuning tests start it."""

from __future__ import annotations

from pathlib import Path

from devtools.launch import ManagedProcess, spawn_site, wait_until_serving
from tests.support.lora_site import write_federation


def start_training_site(
    model_dir: Path, work: Path, reserve_bytes: int = 1 << 30
) -> ManagedProcess:
    """The site `aws-use1` with a fine-tuning reserve of `reserve_bytes`, serving; the
    federation file is work/federation.json."""
    (work / "lora").mkdir(exist_ok=True)
    env = {
        "SITE_FINETUNE_RESERVE_BYTES": str(reserve_bytes),
        "SITE_FINETUNE_DIR": str(work / "finetune"),
        "SITE_LORA_DIR": str(work / "lora"),
        "SITE_MAX_LORA_RANK": "8",
    }
    site = spawn_site(
        model_dir=model_dir, site_name="aws-use1", model_name="tiny", log_dir=work, env=env
    )
    wait_until_serving(site)
    write_federation(work, model_dir, site)
    return site
