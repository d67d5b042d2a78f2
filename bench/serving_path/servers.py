"""What both modes need of the machine and the servers' processes beside devtools.launch: the
gateway's interpreter, enough file descriptors for a thousand streams, and what the servers'
logs complained of."""

from __future__ import annotations

import re
import resource
from collections import Counter
from pathlib import Path

from devtools import launch

ROOT = Path(__file__).resolve().parents[2]
_PROBLEM = re.compile(r"\b(WARNING|ERROR|CRITICAL)\b|Traceback")
# A log line's time stamp, then its numbers and ids: lines of one kind count together.
_STAMP = re.compile(r"\d{4}-\d\d-\d\d[ T][\d:.,]+ ?(- )?")
_VARYING = re.compile(r"\b\d[\d.:,]*\b|\b[0-9a-f]{16,}\b")


def gateway_python() -> str:
    """The gateway as its image runs it, without torch: the checkout's .venv-gateway (`make
    setup`) where there is one (this machine), else devtools.launch's choice (the GPU machine's
    python3)."""
    own = ROOT / ".venv-gateway" / "bin" / "python"
    return str(own) if own.exists() else launch.gateway_python()


def raise_open_files(wanted: int) -> int:
    """The soft limit on open files raised towards `wanted` (as far as the hard limit allows;
    the servers and clients started later inherit it): a gateway holding a thousand client
    connections and their site streams needs more than a 1,024 default. Returns the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < wanted:
        soft = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return soft


def log_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def log_problems(path: Path, since: int = 0, most: int = 8) -> dict[str, int]:
    """The log's warnings and errors from byte `since` on, by kind (numbers and stamps left
    out), most frequent first."""
    try:
        with path.open("rb") as handle:
            handle.seek(since)
            lines = handle.read().decode(errors="replace").splitlines()
    except OSError:
        return {}
    kinds = Counter(
        _VARYING.sub("#", _STAMP.sub("", line))[:200] for line in lines if _PROBLEM.search(line)
    )
    return dict(kinds.most_common(most))
