"""A ranking head on the length classifier's encoder, trained to order answers by length.

vLLM-LTR (Fu et al., "Efficient LLM Scheduling by Learning to Rank", 2024) trains a small model
to output one score per prompt with a listwise loss (ListMLE over each batch of 32 prompts,
lengths grouped by 10 tokens so that near-equal answers are ties broken at random), and
measures it by Kendall's tau: shortest-predicted-first needs the order of the answers, not
their lengths. Here the score is a second head on the served classifier's encoder (a shared
encoder with two heads): the classifier keeps naming buckets and their probabilities, the
ranking head orders prompts, and its score is mapped to tokens by predictor.score_map.

The head is residual over what the classifier already knows:

    score = a * log(expected length of the classifier) + MLP(encoder features)

with a = 1 and the MLP's last layer zero at the start, so training starts from exactly the
classifier's order and the loss moves it from there. The encoder is frozen: its features are
computed once (the costly part on two cores), the head trains in seconds on them, on
training-split prompts the classifier never saw (their features are what serving sees, not the
ones the encoder was fitted to).

Losses (`RankConfig.loss`):
- "listmle": -log of the Plackett-Luce likelihood of the true order (longest first) of each list;
- "pairwise": margin ranking, mean over the list's ordered pairs of max(0, margin - (s_i - s_j))
  for every pair whose lengths differ by more than the tie width.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch import nn

from predictor.encoding import PromptEncoder, prompt_chars
from predictor.minilm import OUTPUT_NAME, LengthClassifier, export_graph
from predictor.score_map import RANK_OUTPUT

Progress = Callable[[str], None]
Loss = Literal["listmle", "pairwise", "pointwise"]
LOSSES: tuple[Loss, ...] = ("listmle", "pairwise", "pointwise")
_FEATURE_BATCH = 64


@dataclass(frozen=True, slots=True)
class RankConfig:
    # Pairwise margin ranking plus the length term: on training-split prompts set aside it ranked
    # best (Kendall's tau 0.539 against ListMLE alone 0.517, ListMLE + length term 0.536, the
    # length term alone 0.537, the classifier 0.511) with the lowest MAE of the ranking losses
    # (bench/results/predictor/predictor_rank_sweep.md).
    loss: Loss = "pairwise"
    list_size: int = 32  # prompts per list (vLLM-LTR: its batch of 32)
    lists_per_step: int = 8  # lists per optimizer step
    tie_tokens: int = 10  # lengths in the same group of this many tokens are ties
    margin: float = 0.1  # the pairwise loss's margin, in score units
    # Weight of a pointwise term, |score - log(length)|: keeps the score a log-length estimate,
    # so its map to tokens keeps what the classifier knew of sizes (0: the ranking loss alone).
    length_weight: float = 1.0
    hidden: int = 128
    epochs: int = 40  # at most; the held-out share of the head's prompts stops it earlier
    patience: int = 5  # epochs without a better held-out loss before stopping
    learning_rate: float = 1e-3
    weight_decay: float = 1e-2
    # Training-split prompts the classifier did not train on that the head learns from (and
    # its score map is fitted on); 0: all of them. Drawn with sample_seed, not seed: the
    # encoder's features of one draw serve every seed of the head (predictor.rank_build).
    max_train: int = 8000
    sample_seed: int = 0
    holdout_fraction: float = 0.15  # of those: early stopping, never trained on
    seed: int = 0
    threads: int = 2

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {self.loss!r}")
        small = min(self.tie_tokens, self.hidden, self.epochs, self.lists_per_step)
        if self.list_size < 2 or small < 1:
            raise ValueError(f"list_size >= 2; tie_tokens, hidden, epochs, lists >= 1: {self}")
        if self.loss == "pointwise" and self.length_weight <= 0:
            raise ValueError("the pointwise head is the length term alone: length_weight > 0")
        if not 0.0 < self.holdout_fraction < 0.5:
            raise ValueError(f"holdout_fraction must be within (0, 0.5), got {self}")

    def to_json(self) -> dict[str, object]:
        return asdict(self)


class RankHead(nn.Module):
    """score = a * log_expected + MLP(features); starts as the classifier's own order."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, 1))
        last = self.mlp[2]
        assert isinstance(last, nn.Linear)
        nn.init.zeros_(last.weight)
        nn.init.zeros_(last.bias)

    def forward(self, features: torch.Tensor, log_expected: torch.Tensor) -> torch.Tensor:
        residual: torch.Tensor = self.mlp(features).squeeze(-1)
        return self.scale * log_expected + residual


def tie_groups(lengths: torch.Tensor, tie_tokens: int) -> torch.Tensor:
    """The length groups the losses compare (equal group: a tie)."""
    return torch.div(lengths, tie_tokens, rounding_mode="floor")


def _as_lists(values: torch.Tensor) -> torch.Tensor:
    """One list given alone becomes a batch of one."""
    return values.unsqueeze(0) if values.dim() == 1 else values


def listmle_loss(
    scores: torch.Tensor, groups: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    """ListMLE of (lists, items) scores: per list, -sum_i log(exp(s_i) / sum_{j ranked at or
    below i} exp(s_j)) with the items in their true order, longest first, divided by the
    list's length; the mean over lists. Ties are ordered at random each call."""
    scores, groups = _as_lists(scores), _as_lists(groups)
    shuffle = torch.argsort(torch.rand(groups.shape, generator=generator), dim=1)
    scores, groups = scores.gather(1, shuffle), groups.gather(1, shuffle)
    order = torch.argsort(groups, dim=1, descending=True, stable=True)
    ranked = scores.gather(1, order)
    # log of sum_{j >= i} exp(s_j): a reversed cumulative logsumexp along each list.
    tail = torch.logcumsumexp(ranked.flip(1), dim=1).flip(1)
    return (tail - ranked).mean()


def pairwise_loss(scores: torch.Tensor, groups: torch.Tensor, margin: float) -> torch.Tensor:
    """Margin ranking over every pair of each list whose groups differ: the mean over those
    pairs of max(0, margin - (s_longer - s_shorter))."""
    scores, groups = _as_lists(scores), _as_lists(groups)
    longer = groups[:, :, None] > groups[:, None, :]
    if not bool(longer.any()):
        return scores.sum() * 0.0
    gaps = scores[:, :, None] - scores[:, None, :]
    return torch.relu(margin - gaps)[longer].mean()


@dataclass(frozen=True, slots=True)
class RankStats:
    epochs: int  # trained
    best_epoch: int  # the one kept (lowest held-out loss); 0: the classifier's order won
    holdout_loss_start: float  # the classifier's order, before training
    holdout_loss: float
    seconds: float


@dataclass(frozen=True, slots=True)
class _Rows:
    features: torch.Tensor
    log_expected: torch.Tensor
    groups: torch.Tensor
    log_lengths: torch.Tensor

    def loss(
        self, head: RankHead, lists: torch.Tensor, config: RankConfig, generator: torch.Generator
    ) -> torch.Tensor:
        """The loss of `lists` ((lists, items) row indexes)."""
        scores = head(self.features[lists], self.log_expected[lists])
        if config.loss == "listmle":
            loss = listmle_loss(scores, self.groups[lists], generator)
        elif config.loss == "pairwise":
            loss = pairwise_loss(scores, self.groups[lists], config.margin)
        else:
            loss = scores.sum() * 0.0
        if config.length_weight > 0:
            loss = loss + config.length_weight * (scores - self.log_lengths[lists]).abs().mean()
        return loss


def _lists(n: int, size: int, rng: np.random.Generator) -> torch.Tensor:
    """(n // size, size) row indexes: a random partition into lists (the rest left out)."""
    order = rng.permutation(n)[: n - n % size]
    return torch.from_numpy(order.reshape(-1, size))


def _holdout_loss(head: RankHead, rows: _Rows, lists: torch.Tensor, config: RankConfig) -> float:
    generator = torch.Generator().manual_seed(config.seed + 1)  # the same tie order each time
    with torch.no_grad():
        return float(rows.loss(head, lists, config, generator))


def train_rank_head(
    features: np.ndarray,
    log_expected: np.ndarray,
    lengths: Sequence[int] | np.ndarray,
    config: RankConfig,
    progress: Progress = print,
) -> tuple[RankHead, RankStats]:
    """Trains the head on (features, log expected length, true length) rows; a held-out share
    (holdout_fraction) picks the epoch to keep (or none: the classifier's own order)."""
    if len(features) != len(log_expected) or len(features) != len(lengths):
        raise ValueError("features, log_expected and lengths need one row per prompt")
    if len(features) < 4 * config.list_size:
        raise ValueError(f"{len(features)} prompts: the head needs at least {4 * config.list_size}")
    # One thread: the head is small, and on a shared machine more threads only wait for each other.
    torch.set_num_threads(1)
    torch.manual_seed(config.seed)
    rng = np.random.default_rng(config.seed)
    generator = torch.Generator().manual_seed(config.seed)
    permuted = rng.permutation(len(features))
    cut = max(config.list_size, int(len(features) * config.holdout_fraction))

    def rows(chosen: np.ndarray) -> _Rows:
        y = torch.as_tensor(np.asarray(lengths, dtype=np.int64)[chosen])
        return _Rows(
            torch.from_numpy(np.asarray(features, dtype=np.float32)[chosen]),
            torch.from_numpy(np.asarray(log_expected, dtype=np.float32)[chosen]),
            tie_groups(y, config.tie_tokens),
            torch.log(y.clamp(min=1).float()),
        )

    held, fit = rows(permuted[:cut]), rows(permuted[cut:])
    held_lists = _lists(cut, config.list_size, np.random.default_rng(config.seed + 2))
    head = RankHead(features.shape[1], config.hidden)
    optimizer = torch.optim.AdamW(
        head.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay
    )
    started = time.monotonic()
    start_loss = best_loss = _holdout_loss(head, held, held_lists, config)
    best_state = {k: v.clone() for k, v in head.state_dict().items()}
    best_epoch = stale = epoch = 0
    for epoch in range(1, config.epochs + 1):
        head.train()
        lists = _lists(len(permuted) - cut, config.list_size, rng)
        for step in range(0, len(lists), config.lists_per_step):
            loss = fit.loss(head, lists[step : step + config.lists_per_step], config, generator)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
        head.eval()
        held_loss = _holdout_loss(head, held, held_lists, config)
        if held_loss < best_loss - 1e-6:
            best_loss, best_epoch, stale = held_loss, epoch, 0
            best_state = {k: v.clone() for k, v in head.state_dict().items()}
        else:
            stale += 1
        if stale >= config.patience:
            break
    head.load_state_dict(best_state)
    head.eval()
    stats = RankStats(epoch, best_epoch, start_loss, best_loss, time.monotonic() - started)
    progress(
        f"ranking head ({config.loss}): held-out loss {start_loss:.4f} -> {best_loss:.4f} "
        f"(epoch {best_epoch} of {epoch}, {stats.seconds:.0f}s)"
    )
    return head, stats


def classifier_features(
    classifier: LengthClassifier,
    encoder: PromptEncoder,
    prompts: Sequence[str],
    representatives: Sequence[float],
    threads: int = 2,
    progress: Progress = print,
) -> tuple[np.ndarray, np.ndarray]:
    """(features, log expected length) of each prompt from the classifier (fp32, eval mode),
    in batches of similar token length."""
    torch.set_num_threads(threads)
    classifier.eval()
    reps = torch.tensor(list(representatives), dtype=torch.float32)
    ids, mask = encoder.encode(prompts)
    chars = prompt_chars(prompts)
    order = np.argsort(mask.sum(axis=1), kind="stable")
    features = np.zeros((len(prompts), classifier.feature_width), dtype=np.float32)
    log_expected = np.zeros(len(prompts), dtype=np.float32)
    started = time.monotonic()
    with torch.inference_mode():
        for number, start in enumerate(range(0, len(order), _FEATURE_BATCH)):
            group = order[start : start + _FEATURE_BATCH]
            width = int(mask[group].sum(axis=1).max())
            x = classifier.features(
                torch.from_numpy(ids[group, :width]),
                torch.from_numpy(mask[group, :width]),
                torch.from_numpy(chars[group]),
            )
            logits = classifier.head(x)
            expected = torch.softmax(logits, dim=-1) @ reps
            features[group] = x.numpy()
            log_expected[group] = torch.log(expected.clamp(min=1.0)).numpy()
            if number % 40 == 0 and number:
                progress(f"  features: {start}/{len(prompts)} ({time.monotonic() - started:.0f}s)")
    return features, log_expected


class RankingModel(nn.Module):
    """The exported graph: (input_ids, attention_mask[, prompt_chars]) -> (probabilities of
    the classifier's buckets, the ranking head's score)."""

    def __init__(
        self, classifier: LengthClassifier, head: RankHead, representatives: Sequence[float]
    ) -> None:
        super().__init__()
        self.classifier = classifier
        self.rank_head = head
        self.representatives: torch.Tensor
        self.register_buffer("representatives", torch.tensor(list(representatives)))

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.classifier.features(*inputs)
        probabilities = torch.softmax(self.classifier.head(features), dim=-1)
        log_expected = torch.log((probabilities @ self.representatives).clamp(min=1.0))
        return probabilities, self.rank_head(features, log_expected)


def export_ranking_onnx(model: RankingModel, path: Path) -> None:
    """ONNX graph with dynamic batch and sequence axes and two outputs: `probabilities`
    (batch, n_buckets) and `rank_score` (batch,)."""
    export_graph(model, model.classifier.length_feature, path, [OUTPUT_NAME, RANK_OUTPUT])
