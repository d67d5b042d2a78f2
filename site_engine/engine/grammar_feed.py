"""Constrained requests' grammars for the engine: compiled off the step loop, handed to their
requests when ready (PagedEngine's grammar component).

A constrained request whose grammar is cached gets it at once; one whose grammar compiles waits
in the scheduler's queue (`awaiting_guide`) while its compile runs on the compiler's threads,
and each step first hands the grammars compiled since to their requests, or ends with an error
those whose compile failed. llguidance is imported only where constraints are served: without
it (a bare GPU image) the site serves everything else and refuses constrained requests.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from fedllm_contract.grammar import ConstraintSpec
from site_engine.engine.core.api import RequestRejected, StructuredOutputUnavailable
from site_engine.engine.core.outputs import StepOutputs
from site_engine.engine.core.scheduler import Scheduler
from site_engine.engine.core.types import FinishReason, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from site_engine.engine.core.types import Guide
    from site_engine.engine.grammar_compiler import GrammarCompiler, GrammarWaits


class GrammarFeed:
    """The compiler (built on first use), the requests waiting for theirs."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        *,
        threads: int,
        timeout_s: float,
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = eos_token_ids
        self._threads = threads
        self._timeout_s = timeout_s
        self._compiler: GrammarCompiler | None = None
        self._waits: GrammarWaits | None = None  # requests whose grammar is compiling

    def adopt(self, compiler: GrammarCompiler) -> bool:
        """A compiler built before the engine (a pooled site builds it while it waits);
        refused (False) unless it masks this engine's logits width."""
        from site_engine.engine.grammar_compiler import GrammarWaits

        if compiler.vocab_size != self._vocab_size:
            return False
        self._compiler, self._waits = compiler, GrammarWaits(compiler)
        return True

    def compiler(self) -> GrammarCompiler:
        """The compiler, built on first use (it reads the whole vocabulary once, ~1.5 s for
        SmolLM2's); StructuredOutputUnavailable where llguidance is not installed."""
        if self._compiler is None:
            try:
                from site_engine.engine.grammar_compiler import GrammarCompiler, GrammarWaits
            except ModuleNotFoundError as exc:
                raise StructuredOutputUnavailable(
                    "this site cannot constrain answers (response_format json_schema, forced "
                    f"tools): {exc.name or 'llguidance'} is not installed on it"
                ) from exc
            self._compiler = GrammarCompiler(
                self._tokenizer,
                self._vocab_size,
                self._eos,
                threads=self._threads,
                timeout_s=self._timeout_s,
            )
            self._waits = GrammarWaits(self._compiler)
        return self._compiler

    def cached(self, constraint: ConstraintSpec) -> Guide | None:
        return self.compiler().cached(constraint)

    def await_compile(self, request_id: str, constraint: ConstraintSpec) -> None:
        """`request_id` waits (queued) for its grammar, compiling off this thread."""
        self.compiler()
        assert self._waits is not None  # made with the compiler
        self._waits.add(request_id, constraint)

    def drop(self, request_id: str) -> None:
        if self._waits is not None:
            self._waits.drop(request_id)

    def __bool__(self) -> bool:
        """Whether some request waits for its grammar."""
        return bool(self._waits)

    def wait(self, seconds: float) -> None:
        """Nothing else to run: waits up to `seconds` for a compile to finish."""
        if self._waits:
            self._waits.wait(seconds)

    def settle(self, scheduler: Scheduler) -> StepOutputs:
        """Hands the grammars compiled since the last step to their requests (now admissible)
        and ends those whose compile failed or ran past its time: their outputs."""
        outputs = StepOutputs()
        if not self._waits:
            return outputs
        ready, failed = self._waits.settle(time.monotonic())
        why = {rid: f"the answer's constraint cannot be enforced: {e}" for rid, e in failed.items()}
        for request_id, guide in ready.items():
            seq = scheduler.get(request_id)
            assert seq is not None  # a request that leaves stops waiting (abort)
            try:
                follow_answer_so_far(guide, seq.prompt_token_ids, seq.sampling)
            except RequestRejected as exc:
                why[request_id] = str(exc)
            else:
                scheduler.set_guide(request_id, guide)
        for request_id, error in why.items():
            scheduler.finish(request_id, FinishReason.ERROR)
            outputs.add(request_id, finish=FinishReason.ERROR, error=error)
        return outputs

    def close(self) -> None:
        if self._compiler is not None:
            self._compiler.close()


def follow_answer_so_far(guide: Guide, prompt: tuple[int, ...], sampling: SamplingParams) -> None:
    """A continuation's prompt ends with the answer so far: its grammar goes on from there."""
    before = sampling.generated_before
    if before and (before > len(prompt) or not all(map(guide.consume, prompt[-before:]))):
        raise RequestRejected("the answer so far does not follow its constraint")
