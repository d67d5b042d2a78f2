"""A unit of training cut into pieces at decoder-layer boundaries (site_engine/finetune/pieces.py):
it trains exactly as the unit run whole, each piece holds the engine's loop about the bound, and
a unit abandoned mid-way unwinds and leaves no hook behind; the unit's tail (loss chunks, the
optimizer step) is cut too. Through a site's jobs, one example far longer than the bound allows
no longer holds the loop for its whole unit (issue 60: units of 2.5-5 s were seen on a CPU site
with a 200 ms bound)."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

from fedllm_contract.fine_tuning import FineTuneHyperparameters, FineTuneSpec
from site_engine.finetune.data import IGNORE, Example
from site_engine.finetune.job_state import PieceRecord
from site_engine.finetune.jobs import FineTuneJobs, FineTuneSettings
from site_engine.finetune.pieces import PiecewiseRun, decoder_layers
from site_engine.finetune.segment_costs import SEGMENT_KINDS, PieceBudget, SegmentCosts
from site_engine.finetune.trainer import LOSS_CHUNK_TOKENS, LoraTrainer, LossChunks
from site_engine.model_loading import LoadedModel, load_model

HP = FineTuneHyperparameters(n_epochs=1, batch_size=2, learning_rate_multiplier=1.0)


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(tiny_llama_dir)


def example(length: int, seed: int) -> Example:
    generator = torch.Generator().manual_seed(seed)
    ids = tuple(int(t) for t in torch.randint(5, 200, (length,), generator=generator))
    return Example(ids, (IGNORE,) * (length // 2) + ids[length // 2 :])


def _lora(trainer: LoraTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def test_a_unit_in_pieces_trains_as_the_whole_unit(tiny: LoadedModel) -> None:
    train = [example(30, 1), example(45, 2)]
    whole, cut = LoraTrainer(tiny.model, HP, 3, train), LoraTrainer(tiny.model, HP, 3, train)
    assert whole.work(10_000) == 90
    layers = decoder_layers(cut.model)
    assert len(layers) == tiny.model.config.num_hidden_layers
    run = PiecewiseRun(lambda: cut.work(10_000), layers, SegmentCosts())
    pieces = 1
    while not run.step():
        pieces += 1
    # One piece before each layer's forward and each layer's backward, and the tail.
    assert pieces == 2 * len(layers) + 1
    assert run.result() == 90
    assert cut.history.losses == whole.history.losses
    for name, weight in _lora(whole).items():
        torch.testing.assert_close(_lora(cut)[name], weight)
    assert all(not layer._forward_pre_hooks and not layer._forward_hooks for layer in layers)


def test_an_abandoned_unit_unwinds_and_its_trainer_goes_on(tiny: LoadedModel) -> None:
    train = [example(30, 1), example(45, 2)]
    trainer = LoraTrainer(tiny.model, HP, 3, train)
    layers = decoder_layers(trainer.model)
    run = PiecewiseRun(lambda: trainer.work(10_000), layers, SegmentCosts())
    assert not run.step()
    assert not run.step()
    run.abandon()
    assert run.done
    assert all(not layer._forward_pre_hooks and not layer._forward_hooks for layer in layers)
    trainer.abandon_partial_step()
    assert trainer.work(10_000) == 90  # the step runs again, whole
    assert trainer.history.step == 1


def test_an_error_in_a_piece_is_the_units() -> None:
    def fail() -> int:
        raise RuntimeError("out of memory, say")

    run: PiecewiseRun[int] = PiecewiseRun(fail, [], SegmentCosts())
    assert run.step()
    with pytest.raises(RuntimeError, match="out of memory"):
        run.result()


def test_a_piece_goes_on_only_while_the_next_segment_is_predicted_to_fit() -> None:
    """Issue 76: a count of boundaries from the last piece's mean put a loss chunk and a
    layer's backward (2-3x a forward) in pieces sized on forwards. Each kind's cost is its own,
    per token of the unit for layers, per segment for loss chunks and the optimizer step."""
    costs = SegmentCosts(smoothing=0.5)
    assert costs.predict("forward", 1000) is None
    costs.observe("forward", 1000, 0.002)  # 2 us a token
    costs.observe("backward", 1000, 0.004)
    costs.observe("loss", 1000, 0.003)  # a chunk, whatever the unit
    assert costs.predict("forward", 2000) == pytest.approx(0.004)
    assert costs.predict("loss", 2000) == pytest.approx(0.003)
    budget = PieceBudget(costs, bound_s=0.009)
    assert budget.fits("forward", "forward", 1000)  # 2 + 2 ms
    assert budget.fits("forward", "forward", 1000)  # 4 + 2
    assert not budget.fits("forward", "backward", 1000)  # 6 + 4 > 9
    # A kind never seen ends the piece: nothing says what it costs.
    assert not PieceBudget(costs, bound_s=1.0).fits("forward", "optimizer", 1000)
    assert not PieceBudget(costs, bound_s=1.0).fits("head", "forward", 1000)


def test_a_jump_in_a_kinds_cost_is_not_averaged_away() -> None:
    """A segment that suddenly cost more (a new shape's first kernels) is predicted at that
    cost until the next one of its kind says otherwise; the mean then follows."""
    costs = SegmentCosts(smoothing=0.25)
    costs.observe("forward", 100, 0.001)
    costs.observe("forward", 100, 0.009)
    assert costs.predict("forward", 100) == pytest.approx(0.009)
    costs.observe("forward", 100, 0.001)
    assert costs.predict("forward", 100) == pytest.approx(0.001 + 0.25 * 0.008 * 0.75, rel=1e-6)
    with pytest.raises(ValueError, match="smoothing"):
        SegmentCosts(smoothing=0)
    with pytest.raises(ValueError, match="segment"):
        costs.observe("loss", 1, -1.0)


def test_pieces_learn_each_kinds_cost_and_fill_the_bound(tiny: LoadedModel) -> None:
    """On the CPU the host's clock is the device's: after a first unit cut at every boundary,
    the second unit's pieces cross several boundaries each, and none runs past the bound by
    more than one segment's misprediction."""
    train = [example(60, 1), example(60, 2)]
    two_epochs = FineTuneHyperparameters(n_epochs=2, batch_size=2, learning_rate_multiplier=1.0)
    trainer = LoraTrainer(tiny.model, two_epochs, 3, train)
    layers = decoder_layers(trainer.model)
    costs = SegmentCosts()

    def tokens() -> int:
        return math.prod(trainer.unit_shape)

    first: PiecewiseRun[int] = PiecewiseRun(
        lambda: trainer.work(10_000, first.pause), layers, costs, math.inf, tokens
    )
    boundaries = 1  # the first unit's pieces: one a boundary crossed, and the last
    while not first.step():
        assert first.last_piece_boundaries == 1
        boundaries += 1
    assert all(costs.known(kind) for kind in ("head", "forward", "loss", "backward"))
    unit = sum(
        (costs.predict(kind, 120) or 0.0) * (len(layers) if kind in ("forward", "backward") else 1)
        for kind in ("head", "forward", "loss", "backward")
    )
    bound = unit / 4  # about four pieces a unit
    second: PiecewiseRun[int] = PiecewiseRun(
        lambda: trainer.work(10_000, second.pause), layers, costs, bound, tokens
    )
    crossed = []
    while not second.step():
        crossed.append(second.last_piece_boundaries)
    assert second.result() == 120
    assert max(crossed) > 1
    # Fewer pieces than the first unit's, however the loaded host's clock moved (a CI run on a
    # 2-core machine cut one piece more than "about four" once: 5 of the first unit's 8).
    assert len(crossed) + 1 < boundaries


def test_the_tail_of_a_unit_is_cut_too_and_trains_the_same(tiny: LoadedModel) -> None:
    """The boundaries no layer hook reaches: between the loss's token chunks and before the
    optimizer step (a long example's tail was one piece of 3-5x the bound on a CPU site). A
    piece also ends at the first boundary past half its time bound, whatever the count."""
    train = [example(600, 1)]  # 300 labelled tokens: two chunks of the loss
    assert sum(e.loss_tokens for e in train) > LOSS_CHUNK_TOKENS
    whole, cut = LoraTrainer(tiny.model, HP, 3, train), LoraTrainer(tiny.model, HP, 3, train)
    whole.work(10_000)
    layers = decoder_layers(cut.model)
    # Costs known for every kind, and a time bound every segment is past: one boundary a piece.
    costs = SegmentCosts()
    for kind in SEGMENT_KINDS:
        costs.observe(kind, 1, 1e-6)
    run: PiecewiseRun[int] = PiecewiseRun(
        lambda: cut.work(10_000, run.pause), layers, costs, bound_s=1e-9
    )
    pieces = 1
    while not run.step():
        assert run.last_piece_boundaries == 1
        pieces += 1
    # The layers' 2 x L, one before each of the two loss chunks (the first ends the decoder's
    # forward: issue 76), one before the unwind, one before the optimizer step, the end.
    assert pieces == 2 * len(layers) + 5
    assert cut.history.losses == whole.history.losses
    for name, weight in _lora(whole).items():
        torch.testing.assert_close(_lora(cut)[name], weight)
    run.pause()  # on any other thread: nothing


def test_loss_chunks_shrink_to_half_the_bound_and_grow_back() -> None:
    """A loss chunk is one segment between two boundaries: on a small model with a large
    vocabulary a 256-token chunk alone was 3-5x a CPU site's 50 ms bound."""
    fixed = LossChunks()
    fixed.observe(256, 10.0)
    assert fixed.tokens == LOSS_CHUNK_TOKENS  # no target: the most, always
    chunks = LossChunks(target_s=0.025)
    chunks.observe(256, 0.2)  # 0.78 ms a token: 32 fit in 25 ms
    assert chunks.tokens == 32
    chunks.observe(32, 0.001)  # much faster now: at most twice as many
    assert chunks.tokens == 64
    chunks.observe(64, 100.0)
    assert chunks.tokens == 16  # the floor: below it a chunk is all launches
    for _ in range(10):
        chunks.observe(chunks.tokens, 0.0001)
    assert chunks.tokens == LOSS_CHUNK_TOKENS  # the memory bound


def test_a_long_example_holds_the_loop_no_longer_than_twice_the_bound(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    """One example whose unit takes several times the bound: every call of run_unit (a piece)
    stays within twice the bound. The bound is set from the whole unit's time measured here,
    so the test holds on a slow or a loaded machine alike."""
    words = " ".join(["lorem ipsum dolor"] * 120)
    line = (
        '{"messages": [{"role": "user", "content": "say it"}, '
        f'{{"role": "assistant", "content": "{words}"}}]}}\n'
    ).encode()
    for _ in range(2):  # the second run is timed: the first builds what a first run builds
        probe = LoraTrainer(tiny.model, FineTuneHyperparameters(1, 1, 1.0), 0, [example(600, 1)])
        began = time.monotonic()
        probe.work(10_000)
    whole_s = time.monotonic() - began
    bound_s = whole_s / 3  # the whole unit is three bounds long
    jobs = FineTuneJobs(
        FineTuneSettings(tmp_path, 1 << 30, max_step_ms=1000 * bound_s, max_tokens=600),
        tiny.model, tiny.tokenizer, "tiny",
    )  # fmt: skip
    hp = FineTuneHyperparameters(n_epochs=3, batch_size=1, learning_rate_multiplier=1.0)
    jobs.start(FineTuneSpec("long", "tiny", line * 2, None, hp, 1))
    jobs.settled("long", timeout_s=60)
    jobs.run_unit()  # builds the trainer: a call of its own
    calls = []
    while jobs.progress("long").state.value != "succeeded":
        calls.append(jobs.run_unit())
    assert jobs.progress("long").step == 6
    assert jobs.largest_unit_run >= 500  # each unit is one long example, never cut
    over = [c for c in calls if c > 2 * bound_s]
    # Allowance for a loaded CPU preempting a piece: at most one call in 20 over twice the bound.
    assert len(over) <= len(calls) // 20, (bound_s, sorted(calls)[-5:])


def test_each_piece_says_where_it_ended_and_the_jobs_report_it(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    """A timeline names what a long piece did (issue 76): the boundary each piece ended at, and
    through the jobs' observer its unit's shape, first piece and end."""
    trainer = LoraTrainer(tiny.model, HP, 3, [example(30, 1), example(45, 2)])
    layers = decoder_layers(trainer.model)
    run = PiecewiseRun(lambda: trainer.work(10_000), layers, SegmentCosts())
    ended = []
    while not run.step():
        ended.append(run.ended_at)
    ended.append(run.ended_at)
    n = len(layers)
    assert ended[:n] == [f"forward {i}" for i in range(n)]
    assert ended[n : 2 * n] == [f"backward {i}" for i in reversed(range(n))]
    assert ended[-1] == "end"
    assert trainer.unit_shape == (2, 45)

    jobs = FineTuneJobs(
        FineTuneSettings(tmp_path, 1 << 30, max_step_ms=1e-6, max_tokens=64),
        tiny.model, tiny.tokenizer, "tiny",
    )  # fmt: skip
    records: list[PieceRecord] = []
    jobs.on_piece = records.append
    data = b'{"messages": [{"role": "user", "content": "hi there"}, {"role": "assistant", ' \
        b'"content": "hello to you"}]}\n' * 2  # fmt: skip
    jobs.start(FineTuneSpec("j", "tiny", data, None, HP, 0))
    jobs.settled("j")
    jobs.run_unit(alone=True)  # the trainer's build: no piece
    while jobs.progress("j").step < 1:
        jobs.run_unit(alone=True)
    assert records[0].first_piece
    assert not any(r.first_piece for r in records[1:])
    assert records[-1].unit_done
    assert records[-1].ended_at == "end"
    assert records[-1].step == 1
    assert not any(r.unit_done for r in records[:-1])
    assert {r.unit_shape for r in records} == {records[-1].unit_shape}
    assert all(r.job_id == "j" and r.boundaries >= 1 for r in records[:-1])


def _on(backend: str) -> bool:
    """Whether torch's SDPA may take `backend` now (its global flag)."""
    enabled: bool = getattr(torch.backends.cuda, f"{backend}_sdp_enabled")()
    return enabled


def test_the_trainers_attention_never_takes_cudnn_and_leaves_the_flags_as_it_found_them(
    tiny: LoadedModel,
) -> None:
    """cuDNN's SDPA builds a graph per new sequence shape (up to 1.4 s on an H200, issue 76's
    timeline): the trainer's attention calls run with it off, and only inside each call."""
    trainer = LoraTrainer(tiny.model, HP, 3, [example(30, 1)])
    seen: list[bool] = []
    attention = [m for m in trainer.model.modules() if type(m).__name__.endswith("Attention")]
    assert attention
    for module in attention:
        module.register_forward_pre_hook(lambda *_: seen.append(_on("cudnn")))
    assert _on("cudnn")
    trainer.work(10_000)
    assert seen == [False] * len(attention)
    assert _on("cudnn")
    assert _on("flash")
    assert _on("mem_efficient")


def test_the_unwind_always_begins_a_piece(tiny: LoadedModel) -> None:
    """The decoder's backward begun (autograd's walk of the graph, on the host) is never the
    middle of a piece, however much room the bound leaves: first in a piece, the host's walk
    runs while the device finishes the serving step queued before it (issue 76, r89)."""
    trainer = LoraTrainer(tiny.model, HP, 3, [example(30, 1), example(45, 2)])
    costs = SegmentCosts()
    for kind in SEGMENT_KINDS:
        costs.observe(kind, 1, 1e-9)  # everything fits: pieces end only where they must
    run: PiecewiseRun[int] = PiecewiseRun(
        lambda: trainer.work(10_000, run.pause), decoder_layers(trainer.model), costs, 1e6
    )
    ended = []
    while not run.step():
        ended.append(run.ended_at)
    assert ended == ["pause"]  # the one cut: before the unwind
    assert run.result() == 90
