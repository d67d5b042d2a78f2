"""A calibrated version of an artifact: the same model, a new calibration map, a new version.

    python -m predictor.calibrate --base DIR --labels predictor/labels/NAME --out DIR \
        [--samples N] [--data-dir D]

The command form fits the map on served-model labels (the first N train-split prompts of a
label directory made by predictor.label_served); the gateway's samples go through
`python -m gateway.retrain_predictor --mode calibrate`, which also gates the result.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from predictor.artifact import (
    MODEL_FILE,
    WEIGHTS_FILE,
    ArtifactError,
    Manifest,
    load_manifest,
    new_version,
    write_artifact,
)
from predictor.calibration import Calibration, CalibrationError, fit_calibration
from predictor.cli import command_parser
from predictor.encoding import PromptEncoder


def write_calibrated(
    base: Path, out: Path, calibration: Calibration, parent_version: str | None = None
) -> Manifest:
    """Writes `base`'s model with `calibration` to `out` under a new version."""
    manifest = load_manifest(base)
    digest = hashlib.sha256(
        (manifest.version + json.dumps(calibration.to_json(), sort_keys=True)).encode()
    ).hexdigest()
    calibrated = replace(
        manifest,
        version=new_version(manifest.kind, f"{manifest.scheme.name}-cal", digest),
        calibration=calibration,
        created="",
        training={
            **manifest.training,
            "parent_version": parent_version or manifest.version,
            "calibrated": {"samples": calibration.samples, "source": calibration.source},
        },
    )
    encoder = PromptEncoder.from_dir(base, manifest.max_tokens)
    weights = base / WEIGHTS_FILE
    extra = {WEIGHTS_FILE: weights} if weights.is_file() else {}
    return write_artifact(out, calibrated, base / MODEL_FILE, encoder, extra)


def main(argv: Sequence[str] | None = None) -> int:
    # Imported here: the label readers pull in the corpora code, which the library use needs not.
    from predictor.runtime import LengthPredictor
    from predictor.served_labels import served_records

    parser = command_parser("predictor.calibrate", __doc__)
    parser.add_argument("--base", type=Path, required=True)
    parser.add_argument("--labels", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--samples", type=int, default=600)
    parser.add_argument("--data-dir", type=Path)
    args = parser.parse_args(argv)
    try:
        records = served_records(args.labels, args.data_dir)["train"][: args.samples]
        predictor = LengthPredictor.load(args.base, threads=2)
        raw = predictor.raw_expected([r.prompt for r in records])
        source = f"{len(records)} labels of {args.labels.name}"
        calibration = fit_calibration(raw, [r.length for r in records], source)
        manifest = write_calibrated(args.base, args.out, calibration)
    except (ArtifactError, CalibrationError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {manifest.version} to {args.out} ({source})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
