"""Starts SGLang's own router (the `sglang-router` wheel's Rust router, its own argument parser)
without the wheel's launcher module, which also imports its Python debugging balancer and so
fastapi, aiohttp and uvicorn: the benchmark carries the wheel alone to the GPU machine.

    python -m bench.federation.sglang_arm --worker-urls URL ... --policy cache_aware --port P
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from sglang_router.router import Router
    from sglang_router.router_args import RouterArgs

    parser = argparse.ArgumentParser(prog="python -m bench.federation.sglang_arm")
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    Router.from_args(RouterArgs.from_cli_args(args, use_router_prefix=False)).start()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
