"""Pieces left queued as they end (site_engine/finetune/pieces.py's PieceLedger): on CUDA a
piece's device work is not waited for as it ends, so the engine prepares its next step while the
device runs the piece; its time and its segments' costs are read when the next call begins. The
ledger is exercised here with host marks, deferred as on CUDA: nothing is learned before it is
taken, every piece is measured exactly once, and each call of the jobs reports the piece before
it (its own when it ends a unit)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from fedllm_contract.fine_tuning import FineTuneHyperparameters, FineTuneSpec
from site_engine.finetune.data import IGNORE, Example
from site_engine.finetune.job_state import PieceRecord
from site_engine.finetune.jobs import FineTuneJobs, FineTuneSettings
from site_engine.finetune.pieces import (
    MeasuredPiece,
    PieceLedger,
    PiecewiseRun,
    _ClosedPiece,
    decoder_layers,
)
from site_engine.finetune.segment_costs import SegmentCosts
from site_engine.finetune.trainer import LoraTrainer
from site_engine.model_loading import LoadedModel, load_model


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(tiny_llama_dir)


def _piece(owner: object, began: float, ended: float) -> _ClosedPiece:
    middle = (began + ended) / 2
    return _ClosedPiece(owner, [("forward", began, middle), ("backward", middle, ended)], 100,
                        began, ended, [0.0005, 0.0005])  # fmt: skip


def test_a_deferred_piece_is_learned_only_when_taken() -> None:
    costs = SegmentCosts()
    ledger = PieceLedger(costs, deferred=True)
    owner = object()
    ledger.close(_piece(owner, 1.0, 1.004))
    assert costs.predict("forward", 100) is None  # not measured yet: nothing waited for
    assert ledger.take(wait=False) == []
    ledger.close(_piece(owner, 2.0, 2.006))
    taken = ledger.take(wait=True)
    assert [o for o, _ in taken] == [owner, owner]
    assert [round(s, 6) for _, s in taken] == [0.004, 0.006]  # oldest first
    assert costs.predict("forward", 100) == pytest.approx(0.003)  # the larger: the last one's
    assert ledger.take(wait=True) == []  # each piece once


def test_an_immediate_ledger_learns_as_a_piece_ends() -> None:
    costs = SegmentCosts()
    ledger = PieceLedger(costs)
    seen: list[MeasuredPiece] = []
    ledger.observer = seen.append
    ledger.close(_piece("run", 0.0, 0.002))
    assert costs.predict("backward", 100) == pytest.approx(0.001)
    ((owner, seconds),) = ledger.take(wait=False)
    assert owner == "run"
    assert seconds == pytest.approx(0.002)
    (measured,) = seen
    assert measured.tokens == 100
    assert [(k, round(d, 6), h) for k, d, h in measured.segments] == [
        ("forward", 0.001, 0.0005),
        ("backward", 0.001, 0.0005),
    ]


def test_deferred_calls_report_the_piece_before_and_lose_none(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    line = (
        b'{"messages": [{"role": "user", "content": "hi there"}, '
        b'{"role": "assistant", "content": "hello to you, and good day"}]}\n'
    )
    jobs = FineTuneJobs(
        FineTuneSettings(tmp_path, 1 << 30, max_step_ms=1e-6, max_tokens=64),
        tiny.model, tiny.tokenizer, "tiny",
    )  # fmt: skip
    ledger = jobs._ledger
    ledger.deferred = True  # as on CUDA
    taken: list[int] = []
    take = ledger.take

    def counting(wait: bool = True) -> list[tuple[object, float]]:
        out = take(wait)
        taken.append(len(out))
        return out

    ledger.take = counting  # type: ignore[method-assign]
    records: list[PieceRecord] = []
    jobs.on_piece = records.append
    hp = FineTuneHyperparameters(n_epochs=1, batch_size=2, learning_rate_multiplier=1.0)
    jobs.start(FineTuneSpec("j", "tiny", line * 4, None, hp, 3))
    jobs.settled("j", timeout_s=60)
    jobs.run_unit()  # the build
    returns, counts = [], []
    while jobs.progress("j").state.value != "succeeded":
        returns.append(jobs.run_unit())
        counts.append(len(jobs.pieces_measured_s))
    # A unit's first piece is left queued with nothing before it (its unit's end took the last
    # piece of the unit before); every other call reports the piece before it, or its own last.
    assert [r == 0.0 for r in returns] == [record.first_piece for record in records]
    assert sum(record.first_piece for record in records) > 1
    # Every piece measured exactly once: its unit's end takes it, or the next call does; a call
    # that ends a unit measures the piece before it and its own, each reported on its own.
    assert sum(taken) == jobs.pieces_run == sum(counts)
    expected = [(not r.first_piece) + r.unit_done for r in records]
    assert counts == expected
    assert not ledger._closed


def test_no_collection_runs_inside_a_piece_and_the_collector_is_left_as_found(
    tiny: LoadedModel,
) -> None:
    """A full collection inside a 5 ms piece took 13 ms on the H200 (issue 76's r89 run): while
    a piece holds the turn the collector is off, and it is on again at each hand-back."""
    hp = FineTuneHyperparameters(n_epochs=1, batch_size=2, learning_rate_multiplier=1.0)
    ids = tuple(range(5, 50))
    train = [
        Example(ids[:30], (IGNORE,) * 15 + ids[15:30]),
        Example(ids, (IGNORE,) * 20 + ids[20:]),
    ]
    trainer = LoraTrainer(tiny.model, hp, 3, train)
    inside: list[bool] = []
    layers = decoder_layers(trainer.model)
    for layer in layers:
        layer.register_forward_pre_hook(lambda *_: inside.append(gc.isenabled()))
    run = PiecewiseRun(lambda: trainer.work(10_000), layers, SegmentCosts())
    assert gc.isenabled()
    while not run.step():
        assert gc.isenabled()  # the engine's thread's turn
    assert gc.isenabled()
    assert inside
    assert not any(inside)
    gc.disable()
    try:  # found off: left off
        again = PiecewiseRun(lambda: trainer.work(10_000), layers, SegmentCosts())
        while not again.step():
            assert not gc.isenabled()
    finally:
        gc.enable()
