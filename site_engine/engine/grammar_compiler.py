"""Compiling constraints for a site's tokenizer, off the engine's thread.

A constraint's grammar is compiled into a matcher for this tokenizer once (least recently used
out past `cache_size`), and each request gets a copy whose state is its own. A schema takes
from a millisecond to about a second to compile (it grows with size: bench/results/
grammar_compile.md); on the engine's thread that second was a second without a token for every
request on the site. So compiles run on a small pool of threads of their own (llguidance builds
a matcher without holding the GIL) and a request whose grammar is not ready waits in the queue,
skipped by admission, while the others step (vLLM's WAITING_FOR_FSM); the engine polls the
compiles between steps.

A compile that runs longer than `timeout_s` refuses its requests (the client gets a 400): its
thread cannot be stopped, so it finishes in the background and its matcher is dropped, but no
request waits for it. The engine thread alone reads and writes the cache and the table of
running compiles; a pool thread only compiles and times its own compile.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import llguidance
import llguidance.hf
from transformers import PreTrainedTokenizerBase

from fedllm_contract.grammar import ConstraintSpec, UnenforceableConstraint, grammar, parser_limits
from site_engine.engine.structured_output import LlgGuide

__all__ = ["Compilation", "CompileTimeout", "GrammarCompiler", "GrammarWaits"]

DEFAULT_CACHE_SIZE = 256
DEFAULT_THREADS = 2
DEFAULT_TIMEOUT_S = 5.0


class CompileTimeout(UnenforceableConstraint):
    """The constraint's grammar took longer to compile than the site allows."""


@dataclass(eq=False, slots=True)
class Compilation:
    """One constraint's compile on the pool, shared by every request waiting for it."""

    spec: ConstraintSpec
    future: Future[llguidance.LLMatcher] = field(default_factory=Future)
    # Written by the pool thread: when it began (time.monotonic()) and how long it took.
    started: float | None = None
    seconds: float | None = None

    @property
    def done(self) -> bool:
        return self.future.done()


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary (the model's logits width)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        cache_size: int = DEFAULT_CACHE_SIZE,
        threads: int = DEFAULT_THREADS,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        if threads < 1 or not timeout_s > 0:
            raise ValueError("a grammar compiler needs threads >= 1 and timeout_s > 0")
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        eos = sorted(eos_token_ids) or None
        # Reads the whole vocabulary holding the GIL (~1 s for SmolLM2's): a site builds its
        # compiler at start-up (site_engine/__main__.py), before it serves.
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        self._cache: OrderedDict[ConstraintSpec, llguidance.LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self._compiling: dict[ConstraintSpec, Compilation] = {}
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar-compile")
        self.compiled = 0  # grammars compiled into the cache (misses), for tests and metrics

    # ---- engine thread -------------------------------------------------------------------
    def cached(self, spec: ConstraintSpec) -> LlgGuide | None:
        """A fresh guide for `spec` if its grammar is compiled, else None."""
        template = self._cache.get(spec)
        if template is None:
            return None
        self._cache.move_to_end(spec)
        return LlgGuide(template.deep_copy())

    def submit(self, spec: ConstraintSpec) -> Compilation:
        """The compile of `spec` on the pool: the one running, or a new one."""
        running = self._compiling.get(spec)
        if running is not None:
            if not running.done:
                return running
            self._adopt(running)
            if spec in self._cache:
                return running  # done since the last poll: its outcome is a guide now
        compilation = Compilation(spec)
        self._compiling[spec] = compilation
        compilation.future = self._pool.submit(self._run, compilation)
        return compilation

    def outcome(self, compilation: Compilation, now: float) -> LlgGuide | None:
        """A fresh guide once `compilation` is done (None while it runs within the time
        limit); UnenforceableConstraint (CompileTimeout past the limit) if it cannot be one.
        Call `collect` first, once per poll."""
        if not compilation.done:
            if compilation.started is not None and now - compilation.started > self.timeout_s:
                raise self._too_slow()
            return None
        # Done after this poll's `collect`: cached now, or no later poll might come to do it (the
        # last waiting request leaves with its guide) and its next request would compile again.
        self._adopt(compilation)
        error = compilation.future.exception()
        if error is not None:
            # A new exception per request: the compile's may be raised for several.
            if isinstance(error, UnenforceableConstraint):
                raise UnenforceableConstraint(str(error))
            raise UnenforceableConstraint(
                f"its grammar could not be compiled ({type(error).__name__}: {error})"
            )
        if compilation.seconds is not None and compilation.seconds > self.timeout_s:
            raise self._too_slow()
        return LlgGuide(compilation.future.result().deep_copy())

    def collect(self) -> None:
        """Moves the compiles that finished within the time limit into the cache."""
        for compilation in list(self._compiling.values()):
            if compilation.done:
                self._adopt(compilation)

    def _adopt(self, compilation: Compilation) -> None:
        """A finished compile leaves the running table once, into the cache if it succeeded
        within the time limit."""
        if self._compiling.get(compilation.spec) is not compilation:
            return  # adopted already, or superseded by a newer compile of the same spec
        del self._compiling[compilation.spec]
        seconds = compilation.seconds or 0.0
        if compilation.future.exception() is None and seconds <= self.timeout_s:
            self._remember(compilation.spec, compilation.future.result())

    def wait(self, compilations: Iterable[Compilation], timeout_s: float) -> None:
        """Returns once one of `compilations` is done, or after `timeout_s`."""
        wait([c.future for c in compilations], timeout=timeout_s, return_when=FIRST_COMPLETED)

    def guide(self, spec: ConstraintSpec) -> LlgGuide:
        """A fresh guide for one request, compiled here if it is not cached (benchmarks and
        tests that want the grammar ready before their requests; no time limit)."""
        guide = self.cached(spec)
        if guide is None:
            self._remember(spec, self._compile(spec))
            guide = self.cached(spec)
            assert guide is not None
        return guide

    def close(self) -> None:
        """Stops taking compiles; one running ends in the background."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _remember(self, spec: ConstraintSpec, matcher: llguidance.LLMatcher) -> None:
        self.compiled += 1
        self._cache[spec] = matcher
        self._cache.move_to_end(spec)
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)

    def _too_slow(self) -> CompileTimeout:
        return CompileTimeout(
            f"compiling its grammar took longer than this site's limit of {self.timeout_s:g} s "
            "(SITE_GRAMMAR_COMPILE_TIMEOUT_S); a smaller schema compiles faster"
        )

    # ---- pool threads --------------------------------------------------------------------
    def _run(self, compilation: Compilation) -> llguidance.LLMatcher:
        started = time.monotonic()
        compilation.started = started
        try:
            return self._compile(compilation.spec)
        finally:
            # Before the future completes: whoever sees it done sees its duration.
            compilation.seconds = time.monotonic() - started

    def _compile(self, spec: ConstraintSpec) -> llguidance.LLMatcher:
        text = grammar(spec)
        matcher = llguidance.LLMatcher(self._tokenizer, text, log_level=0, limits=parser_limits())
        if matcher.is_error():
            raise UnenforceableConstraint(matcher.get_error())
        return matcher


class GrammarWaits:
    """The engine's requests waiting for their grammars, by request id (engine thread)."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self._compiler = compiler
        self._waiting: dict[str, Compilation] = {}

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._waiting

    def add(self, request_id: str, spec: ConstraintSpec) -> None:
        self._waiting[request_id] = self._compiler.submit(spec)

    def drop(self, request_id: str) -> None:
        """It left (cancelled, released, failed): its compile goes on for the cache alone."""
        self._waiting.pop(request_id, None)

    def settle(self, now: float) -> tuple[dict[str, LlgGuide], dict[str, str]]:
        """The requests whose grammar is ready (a guide each) and those whose compile failed or
        ran past its time (why each), no longer waiting; the others wait on."""
        self._compiler.collect()
        ready: dict[str, LlgGuide] = {}
        failed: dict[str, str] = {}
        for request_id, compilation in list(self._waiting.items()):
            try:
                guide = self._compiler.outcome(compilation, now)
            except UnenforceableConstraint as exc:
                failed[request_id] = str(exc)
            else:
                if guide is None:
                    continue
                ready[request_id] = guide
            del self._waiting[request_id]
        return ready, failed

    def wait(self, timeout_s: float) -> None:
        """Returns once a compile some request waits for is done, or after `timeout_s`."""
        self._compiler.wait(self._waiting.values(), timeout_s)
