"""Where a site process's samples go, by thread and function: the py-spy windows that
bench/serving_path/gpu_profile.sh wrote (raw format, `--threads`: each line a stack, its first
frame the thread (`thread (TID): NAME`), its count last).

    python -m bench.serving_path.pyspy_split DIR [--top 12] [--out FILE.md]

Each thread is named by what its stacks run: `engine` (EngineService._run), `event loop`
(asyncio's run_forever), else `other`. Per window: each thread's share of the samples and its
functions by self samples (the leaf frame), and by inclusive samples among the site's own
modules (site_engine/). In a `--gil` window the shares split the interpreter lock's time; in an
`--idle` window a thread's waits count too.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

_THREAD = re.compile(r"^thread \((\w+)\)")
_ROLES = (("engine", "EngineService._run "), ("event loop", "run_forever"))


def parse(lines: Iterable[str]) -> list[tuple[str, list[str], int]]:
    """(thread id, frames from the root, count) per stack line."""
    stacks = []
    for line in lines:
        line = line.rstrip("\n")
        if not line:
            continue
        body, _, count = line.rpartition(" ")
        frames = body.split(";")
        match = _THREAD.match(frames[0]) if frames else None
        thread = match.group(1) if match else "?"
        stacks.append((thread, frames[1:] if match else frames, int(count)))
    return stacks


def roles(stacks: Sequence[tuple[str, list[str], int]]) -> dict[str, str]:
    """Each thread's role, by the samples whose stacks name it."""
    votes: dict[str, Counter[str]] = defaultdict(Counter)
    for thread, frames, count in stacks:
        joined = ";".join(frames)
        role = next((name for name, mark in _ROLES if mark in joined), "other")
        votes[thread][role] += count
    named = {}
    for thread, counter in votes.items():
        known = Counter({r: c for r, c in counter.items() if r != "other"})
        named[thread] = known.most_common(1)[0][0] if known else "other"
    return named


def window_markdown(name: str, stacks: Sequence[tuple[str, list[str], int]], top: int) -> str:
    total = sum(count for _, _, count in stacks)
    if not total:
        return f"### {name}\n\nNo samples.\n"
    role_of = roles(stacks)
    by_role: Counter[str] = Counter()
    leaves: dict[str, Counter[str]] = defaultdict(Counter)
    inclusive: dict[str, Counter[str]] = defaultdict(Counter)
    for thread, frames, count in stacks:
        role = role_of[thread]
        by_role[role] += count
        if frames:
            leaves[role][frames[-1]] += count
        for frame in {f for f in frames if "site_engine/" in f}:
            inclusive[role][frame] += count
    lines = [f"### {name}", "", f"{total:,} samples.", "", "| thread | share |", "|---|---|"]
    lines += [f"| {role} | {n / total:.1%} |" for role, n in by_role.most_common()]
    for role, _ in by_role.most_common():
        lines += ["", f"{role}: self (leaf) samples, of all the window's", ""]
        lines += [f"- {n / total:.1%} `{leaf}`" for leaf, n in leaves[role].most_common(top)]
        lines += ["", f"{role}: inclusive, site_engine's own frames", ""]
        lines += [f"- {n / total:.1%} `{f}`" for f, n in inclusive[role].most_common(top)]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.serving_path.pyspy_split")
    parser.add_argument("folder", type=Path)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    starts = {}
    windows_file = args.folder / "windows.txt"
    if windows_file.is_file():
        for line in windows_file.read_text().splitlines():
            name, _, at = line.partition(" ")
            starts[name] = at
    parts = []
    for path in sorted(args.folder.glob("w*_*.txt")):
        at = starts.get(path.stem)
        title = f"{path.stem} (from {at} s)" if at else path.stem
        parts.append(window_markdown(title, parse(path.read_text().splitlines()), args.top))
    text = "\n".join(parts)
    if args.out is not None:
        args.out.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
