from __future__ import annotations

from pathlib import Path

import pytest

from gateway.settings import GatewaySettings
from gateway.settings import SettingsError as GatewaySettingsError
from site_engine.settings import SettingsError as SiteSettingsError
from site_engine.settings import SiteSettings


def test_gateway_settings_from_env() -> None:
    settings = GatewaySettings.from_env(
        {
            "GATEWAY_FEDERATION_FILE": "f.json",
            "GATEWAY_PORT": "9000",
            "GATEWAY_AUTO_MIGRATE": "false",
            "GATEWAY_HEALTH_INTERVAL_S": "0.5",
            "GATEWAY_PLAN_WITHOUT_PREDICTION": "prompt_only",
        }
    )
    assert settings.routing.plan_without_prediction == "prompt_only"
    assert settings.federation_file == Path("f.json")
    assert (
        settings.server.port,
        settings.database.auto_migrate,
        settings.sites.health_interval_s,
    ) == (9000, False, 0.5)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"GATEWAY_FEDERATION_FILE": ""}, "GATEWAY_FEDERATION_FILE must name"),
        ({"GATEWAY_PORT": "eighty"}, "GATEWAY_PORT must be an integer"),
        ({"GATEWAY_PORT": "70000"}, "GATEWAY_PORT must be in"),
        ({"GATEWAY_AUTO_MIGRATE": "maybe"}, "GATEWAY_AUTO_MIGRATE must be true or false"),
        ({"GATEWAY_ROUTING_POLICY": "random"}, "GATEWAY_ROUTING_POLICY"),
        ({"GATEWAY_DATABASE_URL": "not a url"}, "GATEWAY_DATABASE_URL"),
        ({"GATEWAY_REQUEST_TIMEOUT_S": "0"}, "GATEWAY_REQUEST_TIMEOUT_S"),
        ({"GATEWAY_PLAN_WITHOUT_PREDICTION": "guess"}, "GATEWAY_PLAN_WITHOUT_PREDICTION"),
    ],
)
def test_gateway_settings_fail_loudly(env: dict[str, str], message: str) -> None:
    with pytest.raises(GatewaySettingsError, match=message):
        GatewaySettings.from_env({"GATEWAY_FEDERATION_FILE": "f.json", **env})


def test_site_settings_env_then_flags() -> None:
    env = {"SITE_MODEL_DIR": "/models/llama", "SITE_PORT": "6000", "SITE_DTYPE": "bfloat16"}
    settings = SiteSettings.load(env, port=7000, device=None)
    assert settings.port == 7000  # the flag wins
    assert settings.dtype == "bfloat16"
    assert settings.model_name == "llama"
    assert settings.site_name == "llama"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({}, "model directory is required"),
        ({"SITE_MODEL_DIR": "m", "SITE_PORT": "x"}, "SITE_PORT must be an integer"),
        ({"SITE_MODEL_DIR": "m", "SITE_DTYPE": "int4"}, "SITE_DTYPE"),
        ({"SITE_MODEL_DIR": "m", "SITE_DEVICE": "tpu"}, "SITE_DEVICE"),
        ({"SITE_MODEL_DIR": "m", "SITE_POLICY": "lifo"}, "SITE_POLICY"),
        ({"SITE_MODEL_DIR": "m", "SITE_MAX_NUM_SEQS": "0"}, "SITE_MAX_NUM_SEQS"),
        ({"SITE_MODEL_DIR": "m", "SITE_MAX_LORAS": "9"}, "SITE_MAX_LORAS must be >= 1 and <="),
        ({"SITE_MODEL_DIR": "m", "SITE_MAX_LORA_RANK": "128"}, "SITE_MAX_LORA_RANK in 1..64"),
        ({"SITE_MODEL_DIR": "m", "SITE_SWITCH_INTERVAL_US": "0"}, "SITE_SWITCH_INTERVAL_US"),
        ({"SITE_MODEL_DIR": "m", "SITE_SWITCH_INTERVAL_US": "2e5"}, "SITE_SWITCH_INTERVAL_US"),
    ],
)
def test_site_settings_fail_loudly(env: dict[str, str], message: str) -> None:
    with pytest.raises(SiteSettingsError, match=message):
        SiteSettings.load(env)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"GATEWAY_MAX_CONTINUATIONS": "-1"}, "GATEWAY_MAX_CONTINUATIONS"),
        ({"GATEWAY_SITE_MAX_QUEUED_REQUESTS": "-3"}, "GATEWAY_SITE_MAX_QUEUED_REQUESTS"),
        ({"GATEWAY_MAX_IN_FLIGHT": "0"}, "GATEWAY_MAX_IN_FLIGHT"),
        ({"GATEWAY_IDEMPOTENCY_TTL_S": "0"}, "GATEWAY_IDEMPOTENCY_TTL_S"),
        ({"GATEWAY_OPEN_ANSWER_TIMEOUT_S": "600"}, "GATEWAY_OPEN_ANSWER_TIMEOUT_S"),
        ({"GATEWAY_OPEN_ANSWER_TIMEOUT_S": "0"}, "GATEWAY_OPEN_ANSWER_TIMEOUT_S"),
        (
            {"GATEWAY_REQUEST_TIMEOUT_S": "20", "GATEWAY_OPEN_ANSWER_TIMEOUT_S": "30"},
            "below GATEWAY_REQUEST_TIMEOUT_S",
        ),
    ],
)
def test_reliability_settings_fail_loudly(env: dict[str, str], message: str) -> None:
    with pytest.raises(GatewaySettingsError, match=message):
        GatewaySettings.from_env({"GATEWAY_FEDERATION_FILE": "f.json", **env})


def test_reliability_settings_from_env() -> None:
    settings = GatewaySettings.from_env(
        {
            "GATEWAY_FEDERATION_FILE": "f.json",
            "GATEWAY_MAX_CONTINUATIONS": "0",
            "GATEWAY_MAX_IN_FLIGHT": "7",
            "GATEWAY_SITE_MAX_QUEUED_TOKENS": "5000",
        }
    )
    assert (settings.limits.max_continuations, settings.limits.max_in_flight) == (0, 7)
    # An answer without a client's limit: half the request's deadline unless set.
    assert settings.limits.open_answer_s == 300
    shorter = {"GATEWAY_FEDERATION_FILE": "f.json", "GATEWAY_REQUEST_TIMEOUT_S": "20"}
    assert GatewaySettings.from_env(shorter).limits.open_answer_s == 10
    given = {**shorter, "GATEWAY_OPEN_ANSWER_TIMEOUT_S": "15"}
    assert GatewaySettings.from_env(given).limits.open_answer_s == 15
    assert (settings.routing.site_max_queued_requests, settings.routing.site_max_queued_tokens) == (
        256,
        5000,
    )


def test_site_lora_settings_reach_the_engine(tmp_path: Path) -> None:
    import torch

    from site_engine.__main__ import engine_config, parse_args

    env = {"SITE_MODEL_DIR": "m", "SITE_LORA_DIR": str(tmp_path), "SITE_MAX_LORAS": "2"}
    cpu = torch.device("cpu")
    lora = engine_config(SiteSettings.load(env), cpu).lora
    assert lora is not None
    assert (lora.directory, lora.max_loras, lora.max_cpu_loras, lora.max_rank) == (
        tmp_path,
        2,
        8,
        16,
    )
    assert lora.max_loads == 4  # more than one: cold adapters do not queue behind each other
    loads = engine_config(SiteSettings.load({**env, "SITE_MAX_LORA_LOADS": "7"}), cpu).lora
    assert loads is not None
    assert loads.max_loads == 7
    flags = ["--model", "m", "--lora-dir", str(tmp_path), "--max-lora-loads", "3"]
    assert parse_args(flags).max_lora_loads == 3
    with pytest.raises(SiteSettingsError, match="SITE_MAX_LORA_LOADS must be >= 1, got 0"):
        SiteSettings.load({**env, "SITE_MAX_LORA_LOADS": "0"})
    assert (
        engine_config(SiteSettings.load({"SITE_MODEL_DIR": "m"}), torch.device("cpu")).lora is None
    )
    assert not lora.unified  # fixed slots unless asked
    unified = engine_config(SiteSettings.load({**env, "SITE_LORA_UNIFIED_SLOTS": "1"}), cpu).lora
    assert unified is not None
    assert unified.unified
    flags = ["--model", "m", "--lora-dir", str(tmp_path), "--lora-unified-slots"]
    assert parse_args(flags).lora_unified_slots is True


def test_a_site_taking_fine_tuning_jobs_needs_lora_slots_to_serve_them(tmp_path: Path) -> None:
    env = {"SITE_MODEL_DIR": "m", "SITE_FINETUNE_RESERVE_BYTES": str(1 << 30)}
    with pytest.raises(SiteSettingsError, match="SITE_LORA_DIR"):
        SiteSettings.load(env)
    settings = SiteSettings.load({**env, "SITE_LORA_DIR": str(tmp_path)})
    assert (settings.finetune_reserve_bytes, settings.lora_dir) == (1 << 30, tmp_path)


def test_the_background_time_shares_reach_the_engine_and_bad_ones_are_refused() -> None:
    import torch

    from site_engine.__main__ import engine_config, parse_args

    env = {"SITE_MODEL_DIR": "m"}
    settings = SiteSettings.load(env)
    assert (settings.deferral_bound_slack, settings.finetune_busy_share) == (0.15, 0.15)
    cpu = torch.device("cpu")
    config = engine_config(SiteSettings.load({**env, "SITE_DEFERRAL_BOUND_SLACK": "0.4"}), cpu)
    assert config.background_step_slack == 0.4
    flags = ["--model", "m", "--deferral-bound-slack", "0", "--finetune-busy-share", "1"]
    assert (parse_args(flags).deferral_bound_slack, parse_args(flags).finetune_busy_share) == (
        0.0,
        1.0,
    )
    with pytest.raises(SiteSettingsError, match="SITE_DEFERRAL_BOUND_SLACK must be in"):
        SiteSettings.load({**env, "SITE_DEFERRAL_BOUND_SLACK": "-1"})
    with pytest.raises(SiteSettingsError, match="SITE_FINETUNE_BUSY_SHARE must be in"):
        SiteSettings.load({**env, "SITE_FINETUNE_BUSY_SHARE": "0"})


def test_the_idle_unit_size_is_read_and_a_bad_one_refused() -> None:
    from site_engine.__main__ import parse_args

    env = {"SITE_MODEL_DIR": "m"}
    assert SiteSettings.load(env).finetune_idle_unit_tokens == 4096  # 8 x 512
    read = SiteSettings.load({**env, "SITE_FINETUNE_IDLE_UNIT_TOKENS": "2048"})
    assert read.finetune_idle_unit_tokens == 2048
    flags = ["--model", "m", "--finetune-idle-unit-tokens", "8192"]
    assert parse_args(flags).finetune_idle_unit_tokens == 8192
    with pytest.raises(SiteSettingsError, match="SITE_FINETUNE_IDLE_UNIT_TOKENS must be >= 1"):
        SiteSettings.load({**env, "SITE_FINETUNE_IDLE_UNIT_TOKENS": "0"})
