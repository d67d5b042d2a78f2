"""Links cannot rot: every relative link of the README, docs/ and the results index names a file
that exists, every `bench/results/...` path the code and docs mention exists, and the results
stay in one folder per benchmark (issue 48: 285 files in one folder, no telling which was
current)."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from bench.common import RESULTS_DIR

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted(
    [REPO / "README.md", REPO / "predictor" / "README.md", RESULTS_DIR / "README.md",
     *(REPO / "docs").glob("*.md")]
)  # fmt: skip
# [text](target) and [label]: target; the target up to a space (a title may follow) or ")".
INLINE = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)", re.MULTILINE)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto: ...
MENTION = re.compile(r"bench/results/([A-Za-z0-9_.{},*/<>-]+)")
SOURCES = ("README.md", "Makefile", "pyproject.toml", "docs", "bench", "gateway", "site_engine",
           "predictor", "fedllm_contract", "devtools", "tests", "infra", "docker")  # fmt: skip


def relative_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)  # code is not a link
    targets = INLINE.findall(text) + REFERENCE.findall(text)
    return [t for t in targets if not EXTERNAL.match(t) and not t.startswith("#")]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = [
        target
        for target in relative_links(page)
        if not (page.parent / target.split("#", 1)[0]).exists()
    ]
    assert broken == [], f"{page.relative_to(REPO)} links to files that do not exist"


def test_the_link_finder_sees_links() -> None:
    page = "[a](docs/x.md) [b](https://example.com) [c](#top) [d](../y.md#part)\n[e]: z.md\n"
    path = REPO / "test-artifacts" / "links.md"
    path.parent.mkdir(exist_ok=True)
    path.write_text(page)
    assert relative_links(path) == ["docs/x.md", "../y.md#part", "z.md"]


def expansions(mention: str) -> list[str]:
    """`a_{before_,}b.md` -> a_before_b.md, a_b.md."""
    parts = re.split(r"(\{[^}]*\})", mention)
    choices = [p[1:-1].split(",") if p.startswith("{") else [p] for p in parts]
    return ["".join(c) for c in itertools.product(*choices)]


def mentioned_paths() -> dict[str, set[str]]:
    """Every bench/results path that a source or doc file mentions -> the files mentioning it.
    Placeholders (`<name>`, `NAME`) and the results' own records are not mentions."""
    found: dict[str, set[str]] = {}
    files = [RESULTS_DIR / "README.md"]
    for source in SOURCES:
        root = REPO / source
        files += [root] if root.is_file() else sorted(root.rglob("*"))
    for path in files:
        if path.suffix not in {".py", ".md", ".toml", ".tf", ""} or not path.is_file():
            continue
        if RESULTS_DIR in path.parents and path.name != "README.md":
            continue
        for raw in MENTION.findall(path.read_text(errors="replace")):
            mention = raw.rstrip(".,;:/")
            if not mention or "<" in mention or "NAME" in mention or "BENCHMARK" in mention:
                continue
            found.setdefault(mention, set()).add(str(path.relative_to(REPO)))
    return found


def test_every_results_path_mentioned_exists() -> None:
    missing = {
        mention: sorted(where)
        for mention, where in mentioned_paths().items()
        for name in expansions(mention)
        if not list(RESULTS_DIR.glob(name))
    }
    assert missing == {}


def test_results_are_in_one_folder_per_benchmark_all_indexed() -> None:
    top = sorted(p.name for p in RESULTS_DIR.iterdir())
    loose = [name for name in top if not (RESULTS_DIR / name).is_dir() and name != "README.md"]
    assert loose == [], "results belong in their benchmark's folder (bench/results/README.md)"
    index = (RESULTS_DIR / "README.md").read_text()
    folders = [name for name in top if (RESULTS_DIR / name).is_dir()]
    unindexed = [name for name in folders if f"`{name}/`" not in index]
    assert unindexed == []


def test_benchmarks_write_into_existing_results_folders() -> None:
    """Writers name their folder through bench.common.results_dir, and the folder exists; none
    writes into bench/results itself."""
    named: set[str] = set()
    for path in sorted((REPO / "bench").rglob("*.py")):
        text = path.read_text()
        named |= set(re.findall(r"results_dir\(\"([a-z_]+)\"\)", text))
        if path.name != "common.py":
            assert "RESULTS_DIR" not in text, path
            assert not re.search(r"Path\(\"bench/results\"\)", text), path
    assert named, "no writer found: the pattern above is out of date"
    assert sorted(n for n in named if not (RESULTS_DIR / n).is_dir()) == []


def test_code_reaches_results_through_the_benchmarks_folders() -> None:
    """No code builds a path into bench/results by hand (a test once read a result file at its
    old place): it asks bench.common.results_dir for the benchmark's folder."""
    built = re.compile(r"\"bench\"\s*/\s*\"results\"|[\"']bench/results[\"']")
    offenders = [
        str(path.relative_to(REPO))
        for source in ("bench", "tests", "devtools", "gateway", "site_engine", "predictor")
        for path in sorted((REPO / source).rglob("*.py"))
        if path != REPO / "bench" / "common.py" and built.search(path.read_text())
    ]
    assert offenders == []
