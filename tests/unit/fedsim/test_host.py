"""The engine loop's host term: what async scheduling hides, fitted on whole engine steps."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fedsim.calibrate.host import fit_host
from fedsim.step_time import HostOverhead, StepFeatures, StepTimeModel

KERNEL = StepTimeModel(
    "h200", base_s=2e-3, per_prefill_token_s=0.0, per_decode_row_s=1e-5, per_kv_token_s=0.0
)


def decode(rows: int) -> StepFeatures:
    return StepFeatures(0, rows, 0, 0, 0)


def test_period_is_the_longer_of_device_and_host() -> None:
    host = HostOverhead(base_s=3e-4, per_row_s=5e-6)
    model = replace(KERNEL, host=host)
    # 100 rows: grid 3 ms = device 2.2 ms + host 0.8 ms in series; overlapped: 2.2 ms.
    assert model.seconds(decode(100)) == pytest.approx(2.2e-3)
    # A host slower than the device (loop_scale) sets the period.
    slow = replace(KERNEL, host=replace(host, loop_scale=4.0))
    assert slow.seconds(decode(100)) == pytest.approx(3.2e-3)
    # No host term: the grid's time.
    assert KERNEL.seconds(decode(100)) == pytest.approx(3e-3)


def test_fit_host_recovers_the_hidden_time() -> None:
    truth = HostOverhead(base_s=2.5e-4, per_row_s=7e-6)
    rows = [(decode(b), replace(KERNEL, host=truth).seconds(decode(b))) for b in (1, 32, 128, 256)]
    fitted = fit_host(KERNEL, rows)
    assert fitted.base_s == pytest.approx(truth.base_s, rel=1e-6)
    assert fitted.per_row_s == pytest.approx(truth.per_row_s, rel=1e-6)


def test_host_term_round_trips_through_json() -> None:
    model = replace(KERNEL, host=HostOverhead(1e-4, 2e-6, 1.5))
    assert StepTimeModel.from_json(model.to_json()) == model
    with pytest.raises(ValueError, match="unknown"):
        StepTimeModel.from_json({**model.to_json(), "bogus_s": 1.0})
