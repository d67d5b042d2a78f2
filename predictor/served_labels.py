"""Answer lengths of the served model: the label file a served-model predictor is trained on.

A label directory holds `manifest.json` (which model, how it was sampled, which corpora) and
`labels.jsonl`, one line per labelled prompt, appended as batches finish so that an interrupted
run resumes where it stopped. A prompt is keyed by (corpus, index) in `predictor.datasets`'
file order, plus the SHA-256 of its text so that a changed dataset file is noticed, not
silently mislabelled.

The lengths are counted in the served model's tokens, up to and including its EOS token when
the answer stopped there (`finish_reason` "stop") or up to `max_tokens` ("length": the true
length is at least this, a censored label). `served_records` joins a label directory with its
corpora: what every build, calibration and bench of the served predictor trains and scores on.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from predictor.datasets import PromptRecord, load_corpus
from predictor.prepare import LabeledRecord, split_of

DEFAULT_LABELS = Path(__file__).resolve().parent / "labels" / "smollm2-135m-instruct"
MANIFEST_NAME = "manifest.json"
LABELS_NAME = "labels.jsonl"
FinishReason = Literal["stop", "length"]


class LabelFileError(RuntimeError):
    """A label directory is missing, malformed, or belongs to another labelling run."""


@dataclass(frozen=True, slots=True)
class LabelManifest:
    """How the labels were made; a resumed run must match it exactly."""

    model: str
    max_tokens: int
    temperature: float
    seed: int
    chat_template: bool
    dtype: str
    corpora: tuple[str, ...]
    extra: dict[str, Any] = field(default_factory=dict)

    def same_run(self, other: LabelManifest) -> bool:
        mine, theirs = asdict(self), asdict(other)
        mine.pop("extra"), theirs.pop("extra")
        return bool(mine == theirs)


@dataclass(frozen=True, slots=True)
class ServedLabel:
    corpus: str
    index: int
    prompt_sha256: str
    prompt_tokens: int
    answer_tokens: int
    finish_reason: FinishReason

    @property
    def key(self) -> tuple[str, int]:
        return (self.corpus, self.index)


def prompt_digest(prompt: str) -> str:
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()


def write_manifest(directory: Path, manifest: LabelManifest) -> None:
    """Creates the directory's manifest, or checks that an existing one describes the same run."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / MANIFEST_NAME
    if path.is_file():
        existing = read_manifest(directory)
        if not existing.same_run(manifest):
            raise LabelFileError(
                f"{path} describes another labelling run ({existing}); "
                "use a new --out directory or delete this one"
            )
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(manifest), indent=2, sort_keys=True) + "\n")
    tmp.replace(path)


def read_manifest(directory: Path) -> LabelManifest:
    path = directory / MANIFEST_NAME
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        raw["corpora"] = tuple(raw["corpora"])
        return LabelManifest(**raw)
    except FileNotFoundError as exc:
        raise LabelFileError(f"{directory} has no {MANIFEST_NAME}: not a label directory") from exc
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise LabelFileError(f"{path} is not a label manifest: {exc}") from exc


def append_labels(directory: Path, labels: Iterable[ServedLabel]) -> None:
    """Appends whole lines and flushes them to disk: a crash loses at most the open batch."""
    with (directory / LABELS_NAME).open("a", encoding="utf-8") as handle:
        for label in labels:
            handle.write(json.dumps(asdict(label), separators=(",", ":")) + "\n")
        handle.flush()


def read_labels(directory: Path) -> list[ServedLabel]:
    """Every complete line; a torn last line (a crash mid-write) is ignored, others are errors."""
    path = directory / LABELS_NAME
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8").split("\n")
    labels: dict[tuple[str, int], ServedLabel] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            label = ServedLabel(**json.loads(line))
        except (ValueError, TypeError) as exc:
            if number >= len(lines) - 1:  # the torn tail of an interrupted append
                break
            raise LabelFileError(f"{path}:{number}: not a label line: {exc}") from exc
        if label.finish_reason not in ("stop", "length"):
            raise LabelFileError(f"{path}:{number}: finish_reason {label.finish_reason!r}")
        labels[label.key] = label
    return list(labels.values())


def join_records(
    records: Iterable[PromptRecord], labels: Iterable[ServedLabel]
) -> Iterator[tuple[PromptRecord, ServedLabel]]:
    """Pairs each labelled record with its label; a prompt whose text changed is an error."""
    by_key = {label.key: label for label in labels}
    for record in records:
        label = by_key.get((record.corpus, record.index))
        if label is None:
            continue
        if label.prompt_sha256 != prompt_digest(record.prompt):
            raise LabelFileError(
                f"{record.corpus}[{record.index}] changed since it was labelled: relabel it"
            )
        yield record, label


def served_records(
    labels_dir: Path, data_dir: str | Path | None = None, exclude: Collection[str] = ()
) -> dict[str, list[LabeledRecord]]:
    """Labelled prompts by split ("train", "validation", "test"), lengths in served tokens,
    without the corpora named in `exclude`."""
    manifest = read_manifest(labels_dir)
    labels = read_labels(labels_dir)
    if not labels:
        raise LabelFileError(f"{labels_dir} holds no labels yet: run predictor.label_served")
    unknown = set(exclude) - set(manifest.corpora)
    if unknown or set(exclude) >= set(manifest.corpora):
        raise LabelFileError(
            f"cannot exclude {sorted(exclude)}: the labels cover {list(manifest.corpora)}, "
            "and at least one must stay"
        )
    splits: dict[str, list[LabeledRecord]] = {"train": [], "validation": [], "test": []}
    for corpus in manifest.corpora:
        if corpus in exclude:
            continue
        records = load_corpus(corpus, data_dir)  # type: ignore[arg-type]
        for record, label in join_records(records, labels):
            labeled = LabeledRecord(
                f"{record.corpus}:{record.index}", record.corpus, record.prompt, label.answer_tokens
            )
            splits[split_of(record.prompt)].append(labeled)
    return splits
