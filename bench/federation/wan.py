"""A wide-area latency injector: a TCP proxy per site that delays every byte by a one-way delay
plus jitter in each direction, never reordering a stream.

    python -m bench.federation.wan --route NAME:LISTEN_PORT:TARGET_PORT:RTT_MS:JITTER_MS ...

Each direction of a connection reads what arrives, stamps it due at now + RTT/2 + a uniform
draw in [0, jitter], and writes it when due; a chunk is never due before the one read ahead of
it (the due times are kept non-decreasing), so bytes keep their order, as TCP would, and jitter
only ever delays. Prints `READY` once every route listens. Runs until SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

_CHUNK = 1 << 16


@dataclass(frozen=True, slots=True)
class Route:
    name: str
    listen_port: int
    target_port: int
    rtt_ms: float
    jitter_ms: float

    @classmethod
    def parse(cls, text: str) -> Route:
        try:
            name, listen, target, rtt, jitter = text.split(":")
            route = cls(name, int(listen), int(target), float(rtt), float(jitter))
        except ValueError as exc:
            raise argparse.ArgumentTypeError(
                f"--route wants NAME:LISTEN_PORT:TARGET_PORT:RTT_MS:JITTER_MS, got {text!r}"
            ) from exc
        if route.rtt_ms < 0 or route.jitter_ms < 0:
            raise argparse.ArgumentTypeError(f"delays must be >= 0: {text!r}")
        return route

    def spec(self) -> str:
        return f"{self.name}:{self.listen_port}:{self.target_port}:{self.rtt_ms}:{self.jitter_ms}"


@dataclass(slots=True)
class Delay:
    """One direction's delay line: due times never decrease, so nothing overtakes."""

    one_way_s: float
    jitter_s: float
    rng: random.Random
    last_due: float = 0.0

    def due(self, now: float) -> float:
        self.last_due = max(
            self.last_due, now + self.one_way_s + self.rng.uniform(0, self.jitter_s)
        )
        return self.last_due


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: Delay) -> None:
    loop = asyncio.get_running_loop()
    line: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def deliver() -> None:
        while True:
            due, data = await line.get()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                with contextlib.suppress(OSError):
                    if writer.can_write_eof():
                        writer.write_eof()
                return
            writer.write(data)
            await writer.drain()

    sender = asyncio.create_task(deliver())
    try:
        while True:
            data = await reader.read(_CHUNK)
            line.put_nowait((delay.due(loop.time()), data))
            if not data:
                break
        await sender
    except (ConnectionError, OSError):
        sender.cancel()


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def _handler(route: Route, seed: int) -> Handler:
    rng = random.Random(seed)
    one_way, jitter = route.rtt_ms / 2000.0, route.jitter_ms / 1000.0

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            site_r, site_w = await asyncio.open_connection("127.0.0.1", route.target_port)
        except OSError:
            client_w.close()
            return
        try:
            await asyncio.gather(
                _pipe(client_r, site_w, Delay(one_way, jitter, rng)),
                _pipe(site_r, client_w, Delay(one_way, jitter, rng)),
            )
        finally:
            for writer in (site_w, client_w):
                writer.close()

    return handle


async def serve(routes: Sequence[Route], seed: int = 0) -> None:
    servers = [
        await asyncio.start_server(_handler(route, seed + i), "127.0.0.1", route.listen_port)
        for i, route in enumerate(routes)
    ]
    print("READY", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for server in servers:
        server.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.federation.wan", description=__doc__)
    parser.add_argument("--route", type=Route.parse, action="append", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    asyncio.run(serve(args.route, args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
