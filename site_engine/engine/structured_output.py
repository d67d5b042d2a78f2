"""Constrained decoding at the site: a request's constraint compiled for this site's tokenizer
into a grammar matcher (llguidance), cached by constraint, and the matcher as the Guide the
scheduler advances and the sampler reads (site_engine/engine/types.py).

Compiling a schema for a tokenizer costs about a millisecond (bench/results/grammar_engines.md)
and a new matcher needs the tokenizer's token trie once per engine (~1 s), so the engine keeps
one compiled matcher per constraint (least recently used out past `cache_size`) and gives each
request a copy of it, whose state is that request's alone.

Imports no torch: the masks are written into int32 buffers the sampler owns.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import llguidance
import llguidance.hf
import numpy as np
from transformers import PreTrainedTokenizerBase

from fedllm_contract.grammar import ConstraintSpec, UnenforceableConstraint, grammar
from site_engine.engine.types import Guide

__all__ = ["GrammarCompiler", "LlgGuide", "UnenforceableConstraint", "fill_masks"]

DEFAULT_CACHE_SIZE = 256


class LlgGuide:
    """One request's grammar state (the Guide protocol)."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def consume(self, token: int) -> bool:
        return bool(self._matcher.consume_token(token))

    def fill_mask(self, words: object) -> None:
        """`words`: a C-contiguous int32 numpy row of ceil(vocab / 32) words."""
        address = words.ctypes.data  # type: ignore[attr-defined]
        self._matcher.unsafe_compute_mask_ptr(address, words.nbytes)  # type: ignore[attr-defined]

    def is_finished(self) -> bool:
        return bool(self._matcher.is_stopped())

    @property
    def matcher(self) -> llguidance.LLMatcher:
        return self._matcher

    @property
    def error(self) -> str:
        return str(self._matcher.get_error())


_executor: llguidance.LLExecutor | None = None


def fill_masks(guides: Sequence[Guide], words: np.ndarray) -> None:
    """Writes row i of `words` ([len(guides), ceil(vocab / 32)] int32) with guides[i]'s mask
    of allowed next tokens. llguidance's guides are computed together on its thread pool (the
    host's share of a constrained step: one call, not a Python loop of them); a guide whose
    answer is complete, or in error, allows every token (its row's token is never used: the
    scheduler ended or fails it)."""
    global _executor
    words.fill(-1)
    batch: list[tuple[llguidance.LLMatcher, int]] = []
    for row, guide in enumerate(guides):
        if guide.is_finished():
            continue
        if isinstance(guide, LlgGuide):
            batch.append((guide.matcher, row))
        else:
            guide.fill_mask(words[row])
    if batch:
        if _executor is None:
            _executor = llguidance.LLExecutor()
        _executor.unsafe_compute_mask_ptr(batch, words.ctypes.data, words.shape[1] * 4, len(words))
    words[~words.any(axis=1)] = -1


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary (the model's logits width)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        self.vocab_size = vocab_size
        eos = sorted(eos_token_ids) or None
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        self._cache: OrderedDict[ConstraintSpec, llguidance.LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self.compiled = 0  # constraints compiled (cache misses), for tests and metrics

    def guide(self, spec: ConstraintSpec) -> LlgGuide:
        """A fresh guide for one request; UnenforceableConstraint naming what cannot be
        enforced."""
        template = self._cache.get(spec)
        if template is None:
            template = self._compile(spec)
            self._cache[spec] = template
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(spec)
        return LlgGuide(template.deep_copy())

    def _compile(self, spec: ConstraintSpec) -> llguidance.LLMatcher:
        text = grammar(spec)
        error = llguidance.LLMatcher.validate_grammar(text, self._tokenizer)
        if error:
            raise UnenforceableConstraint(error)
        matcher = llguidance.LLMatcher(self._tokenizer, text, log_level=0)
        if matcher.is_error():
            raise UnenforceableConstraint(matcher.get_error())
        self.compiled += 1
        return matcher
