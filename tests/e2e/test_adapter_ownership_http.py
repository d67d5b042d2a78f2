"""Adapter ownership in the database (issue 58), through two real gateways sharing one real
PostgreSQL database and one real site serving the tiny model with --lora-dir:

- an adapter loaded through one gateway's admin API, private to a key, is private on the other
  replica too, after the loading gateway restarts, and after a load that timed out at the
  gateway (503) and then finished at the site;
- it is owned by the key's id: a second key of the same name gets nothing;
- another key's request for it is answered exactly as for an unknown model (status, body),
  whatever else the request holds (`n: 99`, a huge prompt), and about as fast;
- an adapter with a NaN weight, a FIFO as its config or a model's name is refused (400, 400,
  409) and nothing is registered."""

from __future__ import annotations

import os
import signal
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from sqlalchemy import create_engine, text
from transformers import AutoModelForCausalLM

from devtools.launch import ManagedProcess, start_gateway, stop_all, wait_until_serving
from gateway.db.migrate import sync_url
from site_engine.engine.lora.adapter import BaseShapes
from tests.support.lora_site import spawn_lora_site, write_federation
from tests.unit.engine.test_lora_adapters import write_adapter

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

ADMIN = "admin-token-for-the-adapter-ownership-tests"
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN}"}
PROMPT = "The adapter ownership test begins with"
# The gateways' owner refresh and health checks run every 0.5 s (start_gateway's interval).
SEEN_WITHIN_S = 15.0


class Cluster:
    def __init__(self, work: Path, model_dir: Path, database_url: str) -> None:
        self.work, self.database_url = work, database_url
        self.site = spawn_lora_site(model_dir, work, max_loras=2)
        self.gateways: dict[str, ManagedProcess] = {}
        self.keys: dict[str, tuple[int, str]] = {}
        wait_until_serving(self.site)
        self.federation_file = write_federation(work, model_dir, self.site)

    def start(self, name: str, **env: str) -> None:
        folder = self.work / name
        folder.mkdir(exist_ok=True)
        port = self.gateways[name].port if name in self.gateways else None
        self.gateways[name] = start_gateway(
            federation_file=self.federation_file,
            database_url=self.database_url,
            log_dir=folder,
            port=port,
            env={"GATEWAY_REQUIRE_API_KEYS": "true", "GATEWAY_ADMIN_TOKEN": ADMIN, **env},
        )

    def url(self, gateway: str) -> str:
        return f"http://127.0.0.1:{self.gateways[gateway].port}"

    def admin(self, gateway: str, method: str, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.request(method, f"{self.url(gateway)}/admin/api{path}",
                             headers=ADMIN_HEADERS, timeout=60, **kwargs)  # fmt: skip

    def make_key(self, label: str, name: str) -> None:
        made = self.admin("g1", "POST", "/keys", json={"name": name})
        assert made.status_code == 201, made.text
        self.keys[label] = (made.json()["id"], made.json()["key"])

    def call(self, gateway: str, who: str, path: str, body: dict[str, Any]) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.keys[who][1]}"}
        return httpx.post(f"{self.url(gateway)}/v1{path}", json=body, headers=headers, timeout=60)

    def models(self, gateway: str, who: str) -> set[str]:
        headers = {"Authorization": f"Bearer {self.keys[who][1]}"}
        listed = httpx.get(f"{self.url(gateway)}/v1/models", headers=headers, timeout=30)
        assert listed.status_code == 200, listed.text
        return {model["id"] for model in listed.json()["data"]}

    def owner_rows(self) -> dict[str, tuple[object, ...]]:
        engine = create_engine(sync_url(self.database_url))
        try:
            with engine.connect() as connection:
                rows = connection.execute(
                    text("SELECT name, parent, public, api_key_id FROM adapter_owners")
                )
                return {str(row[0]): tuple(row[1:]) for row in rows}
        finally:
            engine.dispose()


@pytest.fixture(scope="module")
def uploads(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Adapters on the site's machine, outside its adapter directory."""
    root = tmp_path_factory.mktemp("uploads")
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    base, targets = BaseShapes.of_model(model), ("q_proj", "v_proj", "o_proj", "up_proj")
    for seed, name in enumerate(("a-ft", "slow-ft", "nan-ft", "fifo-ft")):
        write_adapter(root / name, base, targets=targets, seed=seed)
    weights = root / "nan-ft" / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    next(t for n, t in sorted(tensors.items()) if n.endswith("lora_B.weight"))[0, 0] = float("nan")
    save_file(tensors, str(weights))
    config = root / "fifo-ft" / "adapter_config.json"
    config.unlink()
    os.mkfifo(config)  # no one ever writes it
    return root


@pytest.fixture(scope="module")
def cluster(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory, postgres_url: str
) -> Iterator[Cluster]:
    from gateway.db.migrate import downgrade

    made = None
    try:
        made = Cluster(tmp_path_factory.mktemp("ownership"), tiny_llama_dir, postgres_url)
        made.start("g1")
        # g2 gives up on a site's adapter load after 2 s (the timed-out load below).
        made.start("g2", GATEWAY_ADAPTER_LOAD_TIMEOUT_S="2")
        made.make_key("a", "tenant-a")
        made.make_key("b", "tenant-b")
        yield made
    finally:
        if made is not None:
            stop_all([*made.gateways.values(), made.site])
        downgrade(postgres_url)  # the session's database, clean for the next module


def _load(cluster: Cluster, gateway: str, name: str, path: Path, **owner: Any) -> httpx.Response:
    body = {"name": name, "path": str(path), "parent": "tiny", **owner}
    return cluster.admin(gateway, "POST", "/adapters", json=body)


def _wait_until(check: Any, what: str) -> None:
    deadline = time.monotonic() + SEEN_WITHIN_S
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def _complete(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, **extra}


def _as_unknown(cluster: Cluster, gateway: str, who: str, model: str, **extra: Any) -> int:
    """`who`'s request for `model` gets what a model that does not exist gets, status and body
    (but for the name it gives); the status."""
    private = cluster.call(gateway, who, "/completions", _complete(model, **extra))
    unknown = cluster.call(gateway, who, "/completions", _complete("no-such-ft", **extra))
    assert private.status_code == unknown.status_code, (private.text, unknown.text)
    assert private.text == unknown.text.replace("no-such-ft", model)
    assert model not in cluster.models(gateway, who)
    return private.status_code


def _usable(cluster: Cluster, gateway: str, who: str, model: str) -> bool:
    answer = cluster.call(gateway, who, "/completions", _complete(model))
    return answer.status_code == 200 and model in cluster.models(gateway, who)


def test_a_private_adapter_stays_private_on_a_replica_and_after_a_restart(
    cluster: Cluster, uploads: Path
) -> None:
    a_id = cluster.keys["a"][0]
    loaded = _load(cluster, "g1", "a-ft", uploads / "a-ft", owner_key="tenant-a")
    assert loaded.status_code == 201, loaded.text
    assert (loaded.json()["owner_key"], loaded.json()["owner_key_id"]) == ("tenant-a", a_id)
    assert cluster.owner_rows()["a-ft"] == ("tiny", False, a_id)
    assert _usable(cluster, "g1", "a", "a-ft")  # at once on the gateway that loaded it
    _wait_until(lambda: _usable(cluster, "g2", "a", "a-ft"), "the replica never serves A")
    # A second key of the same name as A's: owners are key ids (names repeat).
    cluster.make_key("a-again", "tenant-a")
    for gateway in ("g1", "g2"):
        for who in ("b", "a-again"):
            _as_unknown(cluster, gateway, who, "a-ft")

    cluster.gateways["g1"].stop()
    cluster.start("g1")
    for who in ("b", "a-again"):
        _as_unknown(cluster, "g1", who, "a-ft")
    assert _usable(cluster, "g1", "a", "a-ft")
    # A name now given by two live keys is no owner: the operator gives the id.
    ambiguous = _load(cluster, "g1", "other-ft", uploads / "a-ft", owner_key="tenant-a")
    assert ambiguous.status_code == 400, ambiguous.text
    assert ambiguous.json()["error"]["code"] == "invalid_owner_key"


def test_another_keys_adapter_is_answered_as_an_unknown_model_before_validation(
    cluster: Cluster, uploads: Path
) -> None:
    if "a-ft" not in cluster.owner_rows():
        loaded = _load(cluster, "g1", "a-ft", uploads / "a-ft", owner_key_id=cluster.keys["a"][0])
        assert loaded.status_code == 201, loaded.text
    huge = "lorem ipsum dolor sit amet " * 30_000  # 810 kB, under the 1 MiB body limit
    for extra in ({"n": 99}, {"max_tokens": -1}, {"prompt": huge, "n": 99}, {"prompt": huge}):
        assert _as_unknown(cluster, "g1", "b", "a-ft", **extra) == 404
    # The owner's own request with the same bad `n` is validated (400): B's 404 came first.
    owners = cluster.call("g1", "a", "/completions", _complete("a-ft", n=99))
    assert owners.status_code == 400, owners.text

    def seconds(who: str, model: str) -> float:
        started = time.perf_counter()
        answer = cluster.call("g1", who, "/completions", _complete(model, prompt=huge))
        assert answer.status_code == 404
        return time.perf_counter() - started

    # Neither 404 looks at the prompt (the issue measured 0.5 s against 0.06 s when the owner
    # was checked after the prompt was tokenized).
    private = statistics.median(seconds("b", "a-ft") for _ in range(5))
    unknown = statistics.median(seconds("b", "no-such-ft") for _ in range(5))
    assert private < unknown + 0.1, (private, unknown)


def test_a_load_that_timed_out_then_finished_at_the_site_stays_private(
    cluster: Cluster, uploads: Path
) -> None:
    a_id = cluster.keys["a"][0]
    site = cluster.site.popen
    site.send_signal(signal.SIGSTOP)  # the site answers nothing: g2 gives up after 2 s
    try:
        timed_out = _load(cluster, "g2", "slow-ft", uploads / "slow-ft", owner_key_id=a_id)
        # What the load does at the site once it runs: the adapter linked into --lora-dir.
        (cluster.work / "lora" / "slow-ft").symlink_to(uploads / "slow-ft")
    finally:
        site.send_signal(signal.SIGCONT)
    assert timed_out.status_code == 503, timed_out.text
    assert "no answer in 2 s" in timed_out.json()["error"]["message"]
    assert cluster.owner_rows()["slow-ft"] == ("tiny", False, a_id)  # kept: it may finish
    for gateway in ("g1", "g2"):
        _wait_until(lambda g=gateway: _usable(cluster, g, "a", "slow-ft"), f"{gateway}: no A")
        _as_unknown(cluster, gateway, "b", "slow-ft")
    unloaded = cluster.admin("g2", "DELETE", "/adapters/slow-ft")
    assert unloaded.status_code == 200, unloaded.text
    assert "slow-ft" not in cluster.owner_rows()


def test_a_nan_adapter_a_fifo_config_and_a_models_name_are_refused_and_nothing_changes(
    cluster: Cluster, uploads: Path
) -> None:
    before = (cluster.owner_rows(), sorted(os.listdir(cluster.work / "lora")))
    nan = _load(cluster, "g1", "nan-ft", uploads / "nan-ft", owner_key_id=cluster.keys["b"][0])
    assert nan.status_code == 400, nan.text
    error = nan.json()["error"]
    assert error["code"] == "invalid_adapter"
    assert "NaN or infinite" in error["message"]
    assert str(uploads) not in error["message"]  # the site's file layout stays the site's
    started = time.monotonic()
    fifo = _load(cluster, "g1", "fifo-ft", uploads / "fifo-ft")
    assert fifo.status_code == 400, fifo.text
    assert "adapter_config.json is not a regular file" in fifo.json()["error"]["message"]
    assert time.monotonic() - started < 10  # refused, not a site thread blocked for ever
    served_name = _load(cluster, "g1", "tiny", uploads / "a-ft")
    assert served_name.status_code == 409, served_name.text
    assert served_name.json()["error"]["code"] == "adapter_exists"
    assert (cluster.owner_rows(), sorted(os.listdir(cluster.work / "lora"))) == before
    for gateway in ("g1", "g2"):
        assert cluster.models(gateway, "b") & {"nan-ft", "fifo-ft"} == set()
    assert _usable(cluster, "g1", "b", "tiny")  # the site still serves
