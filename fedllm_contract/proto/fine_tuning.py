"""The fine-tuning types' protobuf codec, shared by the two gRPC adapters (site_engine/grpc_server
.py, gateway/sites/grpc_client.py), as options.py is for a request's options: each direction is
written once, so the site and the gateway cannot drift apart field by field."""

from __future__ import annotations

from fedllm_contract.fine_tuning import (
    FineTuneCheckpoint,
    FineTuneHyperparameters,
    FineTuneProgress,
    FineTuneSpec,
    FineTuneState,
)
from fedllm_contract.proto import site_pb2

_STATE_TO_PROTO = {
    FineTuneState.QUEUED: site_pb2.FINE_TUNE_STATE_QUEUED,
    FineTuneState.RUNNING: site_pb2.FINE_TUNE_STATE_RUNNING,
    FineTuneState.SUCCEEDED: site_pb2.FINE_TUNE_STATE_SUCCEEDED,
    FineTuneState.FAILED: site_pb2.FINE_TUNE_STATE_FAILED,
    FineTuneState.CANCELLED: site_pb2.FINE_TUNE_STATE_CANCELLED,
}
_STATE_FROM_PROTO = {value: state for state, value in _STATE_TO_PROTO.items()}


def spec_to_proto(spec: FineTuneSpec) -> site_pb2.FineTuneSpec:
    hp = spec.hyperparameters
    message = site_pb2.FineTuneSpec(
        job_id=spec.job_id,
        base_model=spec.base_model,
        training_jsonl=spec.training_jsonl,
        hyperparameters=site_pb2.FineTuneHyperparameters(
            n_epochs=hp.n_epochs,
            batch_size=hp.batch_size,
            learning_rate_multiplier=hp.learning_rate_multiplier,
            lora_rank=hp.lora_rank,
            lora_alpha=hp.lora_alpha,
            target_modules=hp.target_modules,
        ),
        seed=spec.seed,
        tenant=spec.tenant,
    )
    if spec.validation_jsonl is not None:
        message.validation_jsonl = spec.validation_jsonl
    return message


def spec_from_proto(message: site_pb2.FineTuneSpec) -> FineTuneSpec:
    """ValueError (from the dataclasses' own checks) for a spec that cannot be a job."""
    hp = message.hyperparameters
    return FineTuneSpec(
        job_id=message.job_id,
        base_model=message.base_model,
        training_jsonl=message.training_jsonl,
        validation_jsonl=(
            message.validation_jsonl if message.HasField("validation_jsonl") else None
        ),
        hyperparameters=FineTuneHyperparameters(
            n_epochs=hp.n_epochs,
            batch_size=hp.batch_size,
            learning_rate_multiplier=hp.learning_rate_multiplier,
            lora_rank=hp.lora_rank,
            lora_alpha=hp.lora_alpha,
            target_modules=tuple(hp.target_modules),
        ),
        seed=message.seed,
        tenant=message.tenant,
    )


def progress_to_proto(progress: FineTuneProgress) -> site_pb2.FineTuneProgress:
    message = site_pb2.FineTuneProgress(
        job_id=progress.job_id,
        state=_STATE_TO_PROTO[progress.state],
        step=progress.step,
        total_steps=progress.total_steps,
        trained_tokens=progress.trained_tokens,
        losses=[site_pb2.FineTuneLoss(step=s, loss=v) for s, v in progress.losses],
        validation_losses=[
            site_pb2.FineTuneLoss(step=s, loss=v) for s, v in progress.validation_losses
        ],
        checkpoints=[
            site_pb2.FineTuneCheckpoint(step=c.step, path=c.path, train_loss=c.train_loss)
            for c in progress.checkpoints
        ],
    )
    if progress.adapter_path is not None:
        message.adapter_path = progress.adapter_path
    if progress.error is not None:
        message.error = progress.error
    return message


def progress_from_proto(message: site_pb2.FineTuneProgress) -> FineTuneProgress:
    """ValueError for a state this side does not know (a newer site's)."""
    state = _STATE_FROM_PROTO.get(message.state)
    if state is None:
        raise ValueError(f"unknown fine-tuning state {message.state}")
    return FineTuneProgress(
        job_id=message.job_id,
        state=state,
        step=message.step,
        total_steps=message.total_steps,
        trained_tokens=message.trained_tokens,
        losses=tuple((x.step, x.loss) for x in message.losses),
        validation_losses=tuple((x.step, x.loss) for x in message.validation_losses),
        checkpoints=tuple(
            FineTuneCheckpoint(c.step, c.path, c.train_loss) for c in message.checkpoints
        ),
        adapter_path=message.adapter_path if message.HasField("adapter_path") else None,
        error=message.error if message.HasField("error") else None,
    )
