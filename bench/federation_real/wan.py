"""An emulated wide-area link per site: a TCP proxy that holds every byte for a one-way delay in
each direction, never reordering a stream.

    python -m bench.federation_real.wan --route NAME:LISTEN_PORT:TARGET_PORT:ONE_WAY_MS ...

The gateway names each site by its route's listen port, so all its gRPC (health checks, Info, the
load-report stream, every generation stream) crosses the delay, as a site in another region's
would: a request reaches the site one delay after the gateway sent it, its tokens and load
reports reach the gateway one delay after the site sent them. This is what fedsim's
`SiteSpec.rtt_s` models (half of it each way). Each chunk read is due at now + the delay and
written when due; chunks keep their order (a later read is never due earlier). No jitter and no
bandwidth limit: the simulator has neither. Prints `READY` once every route listens, and runs
until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

_CHUNK = 1 << 16


@dataclass(frozen=True, slots=True)
class Route:
    name: str
    listen_port: int
    target_port: int
    one_way_ms: float

    @classmethod
    def parse(cls, text: str) -> Route:
        try:
            name, listen, target, delay = text.split(":")
            route = cls(name, int(listen), int(target), float(delay))
        except ValueError as exc:
            raise argparse.ArgumentTypeError(
                f"--route wants NAME:LISTEN_PORT:TARGET_PORT:ONE_WAY_MS, got {text!r}"
            ) from exc
        if route.one_way_ms < 0:
            raise argparse.ArgumentTypeError(f"the delay must be >= 0: {text!r}")
        return route

    def spec(self) -> str:
        return f"{self.name}:{self.listen_port}:{self.target_port}:{self.one_way_ms:g}"


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    """Copies reader to writer, each chunk held until `delay_s` after it was read."""
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
            line.put_nowait((loop.time() + delay_s, data))
            if not data:
                break
        await sender
    except (ConnectionError, OSError):
        sender.cancel()


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def _handler(route: Route) -> Handler:
    delay_s = route.one_way_ms / 1000.0

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            site_r, site_w = await asyncio.open_connection("127.0.0.1", route.target_port)
        except OSError:
            client_w.close()
            return
        try:
            await asyncio.gather(_pipe(client_r, site_w, delay_s), _pipe(site_r, client_w, delay_s))
        finally:
            for writer in (site_w, client_w):
                writer.close()

    return handle


async def serve(routes: Sequence[Route]) -> None:
    servers = [
        await asyncio.start_server(_handler(route), "127.0.0.1", route.listen_port)
        for route in routes
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
    parser = argparse.ArgumentParser(
        prog="python -m bench.federation_real.wan", description=__doc__
    )
    parser.add_argument("--route", type=Route.parse, action="append", required=True)
    args = parser.parse_args(argv)
    asyncio.run(serve(args.route))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
