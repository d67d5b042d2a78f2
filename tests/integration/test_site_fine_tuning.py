"""A LoRA fine-tuning job on a real site engine (SmolLM2-135M on CPU, fp32): trained in the
engine loop's idle cycles while it serves requests, its loss curve matches a plain
transformers + peft loop on the same seed and data order, a job torn down mid-way resumes from
its last checkpoint to the same end, and the adapter it writes is served by the engine's LoRA
path and answers in the format the data taught, which the base model does not."""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from fedllm_contract.fine_tuning import (
    FineTuneHyperparameters,
    FineTuneProgress,
    FineTuneSpec,
    FineTuneState,
)
from site_engine.engine.core.api import EngineRequest
from site_engine.engine.core.types import SamplingParams
from site_engine.engine.lora.registry import LoraSettings
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.engine_service import EngineService
from site_engine.finetune.data import IGNORE, Example, encode_file
from site_engine.finetune.jobs import FineTuneJobs, FineTuneSettings
from site_engine.finetune.trainer import BASE_LEARNING_RATE
from site_engine.idle_work import IdleGate
from site_engine.model_loading import LoadedModel, load_model

SEED = 11
HP = FineTuneHyperparameters(n_epochs=5, batch_size=2, learning_rate_multiplier=10.0)
# Small enough to run in CI beside other work (issue 67: 8 examples and 20 steps hit the 300 s
# timeout at load 6-9): 4 examples, 2 steps an epoch, 5 epochs.
EXAMPLES = 4
STEPS_PER_EPOCH = EXAMPLES // HP.batch_size
STEPS = HP.n_epochs * STEPS_PER_EPOCH
CHECKPOINT_EVERY = 5
SYSTEM = "Be brief."


def conversation(a: int, answer: str | None) -> list[dict[str, str]]:
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"What is {a} plus {a + 1}?"},
    ]
    if answer is not None:
        messages.append({"role": "assistant", "content": answer})
    return messages


TRAINING = "\n".join(
    json.dumps({"messages": conversation(a, f"ANSWER: {2 * a + 1}")})
    for a in range(1, EXAMPLES + 1)
).encode()


def spec(job_id: str) -> FineTuneSpec:
    return FineTuneSpec(job_id, "smol", TRAINING, None, HP, SEED)


@pytest.fixture(scope="module")
def loaded(smollm2_dir: Path) -> LoadedModel:
    torch.set_num_threads(1)
    return load_model(smollm2_dir)


def settings(directory: Path, checkpoint_every: int = CHECKPOINT_EVERY) -> FineTuneSettings:
    return FineTuneSettings(directory, 1 << 30, checkpoint_every=checkpoint_every, max_tokens=128)


def standalone_losses(model_dir: Path, examples: list[Example]) -> list[float]:
    """A plain transformers + peft loop: same LoRA, seed, learning rate, schedule, batches."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    torch.manual_seed(SEED)
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])  # fmt: skip
    peft_model = get_peft_model(model, config)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=BASE_LEARNING_RATE * HP.learning_rate_multiplier)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / STEPS)
    losses = []
    for step in range(STEPS):
        epoch, index = divmod(step, STEPS_PER_EPOCH)
        generator = torch.Generator().manual_seed(SEED + epoch)
        order = torch.randperm(EXAMPLES, generator=generator).tolist()
        batch = [examples[i] for i in order[index * 2 : index * 2 + 2]]
        width = max(len(e.input_ids) for e in batch)
        ids = torch.tensor([list(e.input_ids) + [0] * (width - len(e.input_ids)) for e in batch])
        labels = torch.tensor([list(e.labels) + [IGNORE] * (width - len(e.labels)) for e in batch])
        mask = (
            torch.arange(width)[None, :] < torch.tensor([len(e.input_ids) for e in batch])[:, None]
        ).long()
        loss = peft_model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


@dataclass
class Served:
    progress: FineTuneProgress
    answers: int  # requests the site answered while the job ran
    idle_units: int


async def _train_while_serving(
    service: EngineService, jobs: FineTuneJobs, loaded: LoadedModel
) -> Served:
    prompt = tuple(loaded.tokenizer.encode("The capital of France is", add_special_tokens=False))
    jobs.start(spec("job-a"))
    jobs.settled("job-a", timeout_s=60)
    answers = 0
    while not jobs.progress("job-a").state.is_final:
        request = EngineRequest(f"r{answers}", prompt, SamplingParams(max_tokens=4, temperature=0))
        async for event in service.generate(request):
            if event.finish_reason is not None:
                answers += 1
        await asyncio.sleep(0.2)
    return Served(jobs.progress("job-a"), answers, service.idle_units)


@pytest.fixture(scope="module")
def served(loaded: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Served:
    engine = PagedEngine(loaded, EngineConfig(max_num_seqs=4, max_num_batched_tokens=256,
                                              kv_cache_bytes=64 << 20))  # fmt: skip
    jobs = FineTuneJobs(
        settings(tmp_path_factory.mktemp("ft")), loaded.model, loaded.tokenizer, "smol"
    )
    service = EngineService(engine, loaded.tokenizer, idle_work=(jobs, IdleGate(10.0)))
    service.start()
    try:
        return asyncio.run(_train_while_serving(service, jobs, loaded))
    finally:
        service.stop()
        engine.close()


def test_loss_curve_matches_a_standalone_peft_run(
    served: Served, loaded: LoadedModel, smollm2_dir: Path
) -> None:
    progress = served.progress
    assert progress.state is FineTuneState.SUCCEEDED, progress.error
    assert served.answers >= 2  # it served while it trained
    assert served.idle_units >= STEPS
    assert [s for s, _ in progress.losses] == list(range(1, STEPS + 1))
    examples = encode_file(loaded.tokenizer, TRAINING, 128)
    assert progress.trained_tokens == HP.n_epochs * sum(e.trained_tokens for e in examples)
    reference = standalone_losses(smollm2_dir, examples)
    site = [loss for _, loss in progress.losses]
    assert site[0] == pytest.approx(reference[0], rel=1e-4)
    assert site == pytest.approx(reference, rel=2e-2, abs=5e-3)
    assert site[-1] < site[0] / 5  # it learned
    assert [c.step for c in progress.checkpoints] == list(
        range(CHECKPOINT_EVERY, STEPS + 1, CHECKPOINT_EVERY)
    )


def test_a_job_torn_down_mid_way_resumes_from_its_last_checkpoint(
    served: Served, loaded: LoadedModel, tmp_path: Path
) -> None:
    jobs = FineTuneJobs(settings(tmp_path), loaded.model, loaded.tokenizer, "smol")
    jobs.start(spec("job-b"))
    jobs.settled("job-b", timeout_s=60)
    while jobs.progress("job-b").step < CHECKPOINT_EVERY + 2:
        jobs.run_unit()
    del jobs  # the site dies: the two steps after the checkpoint were never checkpointed
    again = FineTuneJobs(settings(tmp_path), loaded.model, loaded.tokenizer, "smol")
    assert again.settled("job-b", timeout_s=60).state is FineTuneState.QUEUED
    again.run_unit()
    # Resumed from the checkpoint: its first unit (token-bounded, so maybe not a whole batch)
    # leaves it at that step or the next, not at 0 or 1.
    assert again.progress("job-b").step in (CHECKPOINT_EVERY, CHECKPOINT_EVERY + 1)
    while not again.progress("job-b").state.is_final:
        again.run_unit()
    final = again.progress("job-b")
    assert final.state is FineTuneState.SUCCEEDED
    whole = dict(served.progress.losses)
    assert math.isclose(final.losses[-1][1], whole[STEPS], rel_tol=1e-3, abs_tol=1e-4)
    after = CHECKPOINT_EVERY + 1
    assert dict(final.losses)[after] == pytest.approx(whole[after], rel=1e-3)


def _greedy(engine: PagedEngine, loaded: LoadedModel, adapter: str | None) -> str:
    text = loaded.tokenizer.apply_chat_template(
        conversation(20, None), tokenize=False, add_generation_prompt=True
    )
    prompt = tuple(loaded.tokenizer.encode(text, add_special_tokens=False))
    sampling = SamplingParams(max_tokens=8, temperature=0)
    engine.add_request(EngineRequest(f"q-{adapter}", prompt, sampling, adapter=adapter))
    tokens: list[int] = []
    while engine.has_unfinished():
        for output in engine.step():
            tokens.extend(output.new_token_ids)
    return str(loaded.tokenizer.decode(tokens, skip_special_tokens=True))


def test_the_adapter_is_served_and_answers_as_taught(
    served: Served, loaded: LoadedModel, tmp_path: Path
) -> None:
    assert served.progress.adapter_path is not None
    (tmp_path / "lora").mkdir()
    lora = LoraSettings(tmp_path / "lora", max_loras=1, max_cpu_loras=1, max_rank=8)
    engine = PagedEngine(loaded, EngineConfig(max_num_seqs=2, kv_cache_bytes=32 << 20, lora=lora))
    try:
        engine.load_adapter("ft-answer", served.progress.adapter_path)
        base = _greedy(engine, loaded, None)
        tuned = _greedy(engine, loaded, "ft-answer")
    finally:
        engine.close()
    assert not base.startswith("ANSWER:"), base
    assert tuned.startswith("ANSWER:"), tuned
