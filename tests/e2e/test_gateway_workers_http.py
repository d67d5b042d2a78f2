"""GATEWAY_WORKERS (issue 74): several gateway processes behind one port on PostgreSQL, a real site
behind them, streamed through the openai SDK; the workers end with their supervisor."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from openai import AsyncOpenAI

from devtools.launch import ManagedProcess, start_gateway, start_site
from tests.e2e.conftest import write_federation

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def site(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ManagedProcess]:
    process = start_site(
        model_dir=tiny_llama_dir,
        site_name="aws-use1",
        model_name="tiny",
        log_dir=tmp_path_factory.mktemp("site"),
    )
    yield process
    process.stop()


def workers_of(supervisor: ManagedProcess) -> list[psutil.Process]:
    return psutil.Process(supervisor.popen.pid).children()


def listening_on(workers: list[psutil.Process], port: int) -> list[psutil.Process]:
    return [
        worker
        for worker in workers
        if any(
            c.status == psutil.CONN_LISTEN and c.laddr.port == port
            for c in worker.net_connections("tcp")
        )
    ]


def test_two_workers_share_the_port_serve_streams_and_end_with_their_supervisor(
    site: ManagedProcess, tiny_llama_dir: Path, tmp_path: Path, postgres_url: str
) -> None:
    federation = write_federation(
        tmp_path / "federation.json", tiny_llama_dir, {"aws-use1": f"127.0.0.1:{site.port}"}
    )
    gateway = start_gateway(
        federation_file=federation,
        database_url=postgres_url,
        log_dir=tmp_path,
        env={"GATEWAY_WORKERS": "2"},
    )
    try:
        workers = workers_of(gateway)
        assert len(workers) == 2
        # The gateway is ready once a worker answers; the other binds the port when its own
        # start is done (a CI run found 1 of 2 listening at that moment).
        deadline = time.monotonic() + 60
        while len(listening := listening_on(workers, gateway.port)) < 2:
            assert time.monotonic() < deadline, listening
            time.sleep(0.1)

        async def one(i: int) -> tuple[str, int]:
            client = AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key="none")
            text, tokens = "", 0
            stream = await client.completions.create(
                model="tiny",
                prompt=f"worker test {i}",
                max_tokens=12,
                stream=True,
                stream_options={"include_usage": True},
            )
            async for chunk in stream:
                text += "".join(choice.text for choice in chunk.choices)
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            await client.close()
            return text, tokens

        async def many() -> list[tuple[str, int]]:
            return await asyncio.gather(*(one(i) for i in range(16)))

        answers = asyncio.run(many())
        assert all(tokens == 12 and text for text, tokens in answers)
    finally:
        pids = [worker.pid for worker in workers_of(gateway)]
        gateway.popen.send_signal(signal.SIGTERM)
        gateway.popen.wait(timeout=60)
        gateway.stop()
    _, alive = psutil.wait_procs(
        [psutil.Process(pid) for pid in pids if psutil.pid_exists(pid)], timeout=10
    )
    assert not alive


def test_several_workers_need_postgresql() -> None:
    from fedllm_contract.env_settings import SettingsError
    from gateway.settings import GatewaySettings

    with pytest.raises(SettingsError, match="needs PostgreSQL"):
        GatewaySettings.from_env({"GATEWAY_FEDERATION_FILE": "f.json", "GATEWAY_WORKERS": "2"})
