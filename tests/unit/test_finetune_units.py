"""Time-bounded units of fine-tuning (issue 54): the pacer that sizes them from measured speed,
the idle gate deciding on the next unit's predicted time, token-bounded micro-batches whose
accumulated gradient is the whole batch's, and the memory estimate against what autograd
really keeps on a small Llama."""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
from torch import nn

from fedllm_contract.fine_tuning import FineTuneHyperparameters, FineTuneSpec
from site_engine.engine.core.api import EngineStats
from site_engine.engine.models.fused import fuse_linears
from site_engine.finetune.data import IGNORE, Example
from site_engine.finetune.jobs import FineTuneJobs, FineTuneSettings
from site_engine.finetune.memory import (
    TrainingShape,
    kept_bytes,
    largest_unit_tokens,
    training_bytes,
)
from site_engine.finetune.pacing import UnitPacer
from site_engine.finetune.trainer import (
    LoraTrainer,
    UnitWidths,
    _module_tensors,
    lora_model,
    pad_batch,
    take,
    unit_tokens,
)
from site_engine.idle_work import IdleGate
from site_engine.model_loading import LoadedModel, load_model

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(tiny_llama_dir)


def stats(waiting: int, running: int) -> EngineStats:
    return EngineStats(waiting, running, 0, 0, 0, 0, 100, 0)


def example(length: int, seed: int) -> Example:
    generator = torch.Generator().manual_seed(seed)
    ids = tuple(int(t) for t in torch.randint(5, 200, (length,), generator=generator))
    half = length // 2
    return Example(ids, (IGNORE,) * half + ids[half:])


def test_the_pacer_sizes_units_to_the_bound_from_measured_speed() -> None:
    pacer = UnitPacer(bound_s=0.05)
    assert pacer.next_budget(cap=10_000) == 1  # nothing measured: one sequence
    assert pacer.predict_s(100) == math.inf
    pacer.observe(1, 40, 0.004)  # one example of 40 tokens, 0.1 ms a token
    assert pacer.next_budget(cap=10_000) == 80  # at most twice what the last unit ran
    pacer.observe(80, 80, 0.008)
    assert pacer.next_budget(cap=10_000) == 160
    pacer.observe(160, 150, 0.015)
    pacer.observe(320, 300, 0.03)
    assert pacer.next_budget(cap=10_000) == 500  # 50 ms / 0.1 ms
    assert pacer.next_budget(cap=300) == 300  # the memory cap
    assert pacer.predict_s(500) == pytest.approx(0.05)


def test_one_slow_unit_shrinks_the_next_instead_of_closing_the_gate() -> None:
    pacer, gate = UnitPacer(bound_s=0.05), IdleGate(0.05)
    pacer.observe(1, 100, 0.01)
    pacer.observe(100, 100, 0.5)  # ten times the bound: the machine was busy, say
    budget = pacer.next_budget(cap=10_000)
    assert budget < 100
    assert gate.allows(stats(0, 3), pacer.predict_s(budget))  # the next one is short again
    assert not gate.allows(stats(0, 3), pacer.predict_s(budget * 2))
    assert not gate.allows(stats(1, 3), 0.0)  # a waiting request: nothing runs
    assert gate.allows(stats(0, 0), math.inf)  # nothing in at all: even an unknown unit


def test_a_unit_over_the_bound_is_held_back_but_not_starved() -> None:
    gate = IdleGate(0.05, patience=4.0)
    running = stats(0, 2)
    assert not gate.allows(running, 0.2, held_s=0.79)  # one sequence is 0.2 s: over the bound
    assert gate.allows(running, 0.2, held_s=0.8)  # after 4 x its length since the last unit
    assert not gate.allows(running, math.inf, held_s=0.19)  # unknown: 4 x the bound
    assert gate.allows(running, math.inf, held_s=0.2)
    assert not gate.allows(stats(1, 2), 0.2, held_s=100.0)  # never with a request waiting
    with pytest.raises(ValueError, match="IdleGate needs"):
        IdleGate(0.05, patience=0.0)


@pytest.mark.parametrize(
    "bad",
    [{"bound_s": 0.0}, {"bound_s": 0.1, "smoothing": 0.0}, {"bound_s": 0.1, "growth": 1.0}],
)
def test_the_pacer_refuses_bad_settings(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="UnitPacer needs"):
        UnitPacer(**bad)


def test_the_pacer_refuses_bad_measurements() -> None:
    pacer = UnitPacer(0.05)
    for args in ((0, 10, 0.1), (1, 0, 0.1), (1, 10, -1.0)):
        with pytest.raises(ValueError, match="cannot be measured"):
            pacer.observe(*args)
    with pytest.raises(ValueError, match="token cap"):
        pacer.next_budget(cap=0)
    assert pacer.seconds_per_token is None  # nothing changed
    assert pacer.budget == 0


def test_a_unit_takes_examples_within_the_token_budget_and_at_least_one() -> None:
    examples = [example(n, i) for i, n in enumerate((10, 30, 20, 5))]
    assert take(examples, 60) == 2  # 2 x 30 = 60 tokens padded; a third makes 3 x 30
    assert take(examples, 59) == 1
    assert take(examples, 5) == 1  # longer than the budget: a unit on its own
    assert take(examples, 10_000) == 4
    assert unit_tokens(examples[:2]) == 60


def _first_step(trainer: LoraTrainer, budget: int) -> tuple[list[int], dict[str, torch.Tensor]]:
    """The units' sizes up to the first optimizer step, and the LoRA gradients it steps on."""
    names = {id(p): n for n, p in trainer.model.named_parameters() if p.requires_grad}
    grads: dict[str, torch.Tensor] = {}

    def keep(optimizer: torch.optim.Optimizer, *_: object) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                grads[names[id(p)]] = p.grad.detach().clone()

    trainer.optimizer.register_step_pre_hook(keep)
    sizes = []
    while trainer.history.step == 0:
        predicted = trainer.next_unit_tokens(budget)
        sizes.append(trainer.work(budget))
        assert sizes[-1] == predicted
    return sizes, grads


def test_token_bounded_units_step_as_the_whole_batch_does(tiny: LoadedModel) -> None:
    hp = FineTuneHyperparameters(n_epochs=1, batch_size=4, learning_rate_multiplier=1.0)
    train = [example(n, i) for i, n in enumerate((12, 40, 7, 25))]
    whole = LoraTrainer(tiny.model, hp, 5, train)
    split = LoraTrainer(tiny.model, hp, 5, train)
    whole_sizes, whole_grads = _first_step(whole, 10_000)
    split_sizes, split_grads = _first_step(split, 30)
    assert len(whole_sizes) == 1
    assert len(split_sizes) > 2
    assert split.history.losses[0][1] == pytest.approx(whole.history.losses[0][1], rel=1e-5)
    assert split.history.trained_tokens == whole.history.trained_tokens == 84
    assert len(whole_grads) == len(split_grads) > 0
    assert sum(float(grad.abs().sum()) for grad in whole_grads.values()) > 0
    for name, grad in whole_grads.items():  # A's are zero at first (B starts at zero)
        torch.testing.assert_close(split_grads[name], grad, rtol=1e-4, atol=1e-7)


def test_rounded_widths_never_pass_the_jobs_longest_example() -> None:
    """Issue 76: on CUDA a unit's width is rounded up to a multiple (fewer shapes, fewer first
    calls of a kernel variant), but the reserve was sized for the job's longest example, so no
    unit is wider than that."""
    widths = UnitWidths(longest=150, multiple=64)
    assert [widths.of(n) for n in (1, 64, 65, 128, 129, 150)] == [64, 64, 128, 128, 150, 150]
    examples = [example(n, i) for i, n in enumerate((70, 100, 30))]
    assert unit_tokens(examples[:2], widths) == 2 * 128
    assert take(examples, 256, widths) == 2  # 2 x 128; three rows would be 3 x 128
    assert take(examples, 255, widths) == 1
    assert unit_tokens(examples) == 3 * 100  # exact widths by default
    with pytest.raises(ValueError, match="multiple >= 1"):
        UnitWidths(longest=10, multiple=0)


def _head_rows(trainer: LoraTrainer) -> list[int]:
    """The row count of every chunk of the loss the output head computes from now on."""
    rows: list[int] = []
    head = trainer.model.get_base_model().get_output_embeddings()
    head.register_forward_hook(lambda _m, args, _out: rows.append(args[0].shape[0]))
    return rows


def test_rounded_widths_train_as_exact_ones(tiny: LoadedModel) -> None:
    """Padded positions are masked and unlabelled: the same loss and gradients. The loss's
    chunks are rounded too (the last one holds any remainder of the labelled tokens), with
    unlabelled rows."""
    hp = FineTuneHyperparameters(n_epochs=1, batch_size=3, learning_rate_multiplier=1.0)
    train = [example(n, i) for i, n in enumerate((12, 40, 27))]
    validation = [example(64, 9)]  # the job's longest: widths may round up to it
    exact = LoraTrainer(tiny.model, hp, 5, train, validation)
    rounded = LoraTrainer(tiny.model, hp, 5, train, validation, width_multiple=16)
    exact_rows, rounded_rows = _head_rows(exact), _head_rows(rounded)
    exact_sizes, exact_grads = _first_step(exact, 10_000)
    rounded_sizes, rounded_grads = _first_step(rounded, 10_000)
    labelled = sum(e.loss_tokens for e in train)
    assert (sum(exact_rows), sum(rounded_rows)) == (labelled, -(-labelled // 16) * 16)
    assert all(rows % 16 == 0 for rows in rounded_rows)
    assert (exact_sizes, rounded_sizes) == ([3 * 40], [3 * 48])
    assert rounded.unit_shape == (3, 48)
    assert rounded.history.losses[0][1] == pytest.approx(exact.history.losses[0][1], rel=1e-5)
    assert rounded.history.trained_tokens == exact.history.trained_tokens
    for name, grad in exact_grads.items():
        torch.testing.assert_close(rounded_grads[name], grad, rtol=1e-4, atol=1e-7)


def _saved_bytes(model: nn.Module, examples: list[Example]) -> int:
    """Bytes of the tensors autograd saves in the unit's forward (the decoder and the labelled
    rows), each storage once and the model's own weights left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    ids, mask, labels = pad_batch(examples, torch.device("cpu"))
    causal = model.get_base_model()  # type: ignore[operator]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        hidden = causal.get_decoder()(input_ids=ids, attention_mask=mask).last_hidden_state
        rows = hidden[:, :-1][labels[:, 1:] != IGNORE]
    assert rows.requires_grad
    return sum(kept.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("targets", [("q_proj", "k_proj", "v_proj", "o_proj"), ALL])
def test_the_estimate_bounds_what_autograd_keeps(
    tiny: LoadedModel, dtype: torch.dtype, targets: tuple[str, ...]
) -> None:
    base = tiny.model if dtype == torch.float32 else _copy_in(tiny.model, dtype)
    hp = FineTuneHyperparameters(1, 2, 1.0, target_modules=targets)
    model = lora_model(base, hp, 0)
    examples = [example(48, 1), example(64, 2)]
    measured = _saved_bytes(model, examples)
    estimate = kept_bytes(TrainingShape.of_model(base), hp, unit_tokens(examples), 64)
    assert measured <= estimate <= 1.1 * measured, (measured, estimate)


def _copy_in(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    import copy

    return copy.deepcopy(model).to(dtype)


def _storages(tensors: Iterable[torch.Tensor]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def test_the_trainer_copies_no_tensor_of_the_served_model(tiny: LoadedModel) -> None:
    """The serving engine fuses q/k/v and gate/up, keeping the fused weights as plain module
    attributes its projections' parameters are views of: the trainer's copy of the module tree
    must share those too (a deepcopy of them was 9 GB more on the 8B shape)."""
    base = _copy_in(tiny.model, torch.float32)
    for layer in base.model.layers:  # type: ignore[union-attr]
        fuse_linears([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj])
        fuse_linears([layer.mlp.gate_proj, layer.mlp.up_proj])
    served = _storages(_module_tensors(base))
    model = lora_model(base, FineTuneHyperparameters(1, 1, 1.0), 0)
    lora = _storages(p for p in model.parameters() if p.requires_grad)
    copied = _storages(_module_tensors(model)) - served - lora
    assert not copied


def test_the_unit_cap_is_the_most_tokens_the_reserve_holds(tiny: LoadedModel) -> None:
    shape, hp = TrainingShape.of_model(tiny.model), FineTuneHyperparameters(1, 4, 1.0)
    reserve = training_bytes(shape, hp, 1000, 100) + 1
    most = largest_unit_tokens(shape, hp, 100, reserve)
    assert most >= 1000
    assert (
        training_bytes(shape, hp, most, 100) <= reserve < training_bytes(shape, hp, most + 1, 100)
    )
    assert largest_unit_tokens(shape, hp, 100, training_bytes(shape, hp, 100, 100) - 1) == 0


def test_a_site_predicts_its_next_unit_from_the_units_it_ran(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    line = (
        b'{"messages": [{"role": "user", "content": "what is two and two"}, '
        b'{"role": "assistant", "content": "two and two make four, as always"}]}\n'
    )
    hp = FineTuneHyperparameters(n_epochs=2, batch_size=4, learning_rate_multiplier=1.0)
    jobs = FineTuneJobs(
        FineTuneSettings(tmp_path, 1 << 30, max_step_ms=1000.0, max_rank=16),
        tiny.model, tiny.tokenizer, "tiny",
    )  # fmt: skip
    jobs.start(FineTuneSpec("j", "tiny", line * 8, None, hp, 1))
    jobs.settled("j", timeout_s=60)
    assert jobs.next_unit_s() == math.inf  # no trainer, nothing measured
    jobs.run_unit()  # builds the trainer: a call of its own
    assert jobs.largest_unit_run == 0
    while jobs.largest_unit_run == 0:  # the first unit, a piece at a time
        jobs.run_unit()
    first = jobs.largest_unit_run
    predicted = jobs.next_unit_s()
    assert 0 < predicted < math.inf
    while jobs.progress("j").step < 2:
        jobs.run_unit()
    assert jobs.largest_unit_run > first  # the budget grew from one example towards the bound
    cap, longest = jobs.unit_cap("j")
    assert cap >= jobs.largest_unit_run >= longest
