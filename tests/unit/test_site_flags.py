"""The site's flags are generated from SiteSettings' fields (issue 79): every flag the
hand-written parser had still parses to the same setting, and every setting has its flag."""

from __future__ import annotations

import argparse
from pathlib import Path

from devtools.settings_table import PAGE, with_tables
from fedllm_contract.env_settings import add_flags, flag_names, variables
from site_engine.__main__ import parse_args
from site_engine.settings import SiteSettings

# The flags of site_engine/__main__.py's hand-written parse_args at 8494ebf, with a value each
# (less --lora-kernels: SITE_LORA_KERNELS went with issue 77's split-K kernels, one path left).
BEFORE = {
    "--model": "m", "--tokenizer": "t", "--task": "generate", "--model-name": "n",
    "--site-name": "s", "--host": "127.0.0.1", "--port": "9", "--device": "cpu",
    "--dtype": "bfloat16", "--max-num-seqs": "3", "--max-num-batched-tokens": "64",
    "--block-size": "8", "--kv-cache-mib": "5", "--policy": "spf",
    "--deferral-bound-tokens": "7", "--deferral-bound-slack": "0.5", "--no-prefix-caching": None,
    "--no-lazy-graphs": None, "--host-kv-cache-gib": "0", "--torch-threads": "2",
    "--metrics-port": "9001", "--http-port": "9002", "--gateway-identity": "gw",
    "--allow-plaintext": None, "--max-queued-requests": "5", "--grammar-compile-threads": "3",
    "--grammar-compile-timeout-s": "2.5", "--lora-dir": "l", "--max-loras": "2",
    "--max-cpu-loras": "3", "--max-cpu-lora-gib": "1.5", "--max-lora-rank": "8",
    "--max-lora-loads": "2", "--lora-unified-slots": None,
    "--finetune-reserve-bytes": "1024", "--finetune-reserve-on-demand": None,
    "--finetune-dir": "f", "--finetune-checkpoint-every": "4", "--finetune-max-step-ms": "50",
    "--finetune-busy-share": "0.5", "--finetune-idle-unit-tokens": "512",
    "--finetune-mode": "rows", "--finetune-max-training-delay-ms": "5", "--log-level": "DEBUG",
}  # fmt: skip
TLS = ("--tls-cert", "--tls-key", "--tls-client-ca")


def test_every_flag_of_the_hand_written_parser_still_sets_its_setting() -> None:
    argv = [part for flag, value in BEFORE.items() for part in (flag, value) if part is not None]
    settings = parse_args([*argv, *(part for flag in TLS for part in (flag, "x.pem"))])
    assert (settings.model_dir, settings.tokenizer_dir, settings.lora_dir) == tuple(
        map(Path, "mtl")
    )
    assert (settings.max_num_seqs, settings.deferral_bound_slack, settings.policy) == (
        3,
        0.5,
        "spf",
    )
    assert (settings.prefix_caching, settings.lazy_graphs, settings.allow_plaintext) == (
        False,
        False,
        True,
    )
    assert settings.lora_unified_slots
    assert settings.finetune_reserve_on_demand
    assert (settings.finetune_mode, settings.log_level, settings.tls_cert) == (
        "rows",
        "DEBUG",
        Path("x.pem"),
    )


def test_a_flag_left_out_leaves_the_variable_and_every_setting_has_a_flag() -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser, SiteSettings)
    given = vars(parser.parse_args([]))
    assert set(given) == {v.path[-1] for v in variables(SiteSettings)}
    assert all(value is None for value in given.values())
    assert flag_names(SiteSettings, "prefix_caching") == ("--prefix-caching", "--no-prefix-caching")
    assert flag_names(SiteSettings, "model_dir") == ("--model",)


def test_the_site_table_is_generated_from_the_settings() -> None:
    text = PAGE.read_text()
    assert with_tables(text) == text, (
        "docs/configuration.md's settings tables are stale: run python -m devtools.settings_table"
    )
