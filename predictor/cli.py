"""The predictor commands' argument parser: `python -m predictor.<command> --help` shows the
module's docstring as written (its command lines and examples keep their layout)."""

from __future__ import annotations

import argparse


def command_parser(module: str, doc: str | None) -> argparse.ArgumentParser:
    """The parser of `python -m <module>`, described by the module's docstring `doc`."""
    return argparse.ArgumentParser(
        prog=f"python -m {module}",
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
