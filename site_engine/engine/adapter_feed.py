"""The engine's LoRA adapters (PagedEngine's adapter component): which it serves, loading and
unloading them at run time, and the requests that wait for theirs to reach host memory.

A request of an adapter not in host memory is queued as `awaiting_adapter` while the registry
reads it off this thread; each step first admits the requests of adapters loaded since, and ends
with an error those whose adapter failed to load. Device slots are the registry's
(lora/registry.py); which adapters run in one step is the scheduler's `max_loras`.
"""

from __future__ import annotations

from pathlib import Path

from site_engine.engine.core.api import AdapterRefused, RequestRejected
from site_engine.engine.core.outputs import StepOutputs
from site_engine.engine.core.scheduler import Scheduler
from site_engine.engine.core.types import FinishReason
from site_engine.engine.lora.adapter import AdapterError
from site_engine.engine.lora.registry import AdapterRegistry, AdapterResidency


class AdapterFeed:
    """The registry of a site started with adapters (None: the base model only)."""

    def __init__(self, registry: AdapterRegistry | None) -> None:
        self.registry = registry

    def served(self) -> tuple[str, ...]:
        """The adapters requests may name, sorted; () if none."""
        return self.registry.served() if self.registry is not None else ()

    def _live(self) -> AdapterRegistry:
        if self.registry is None:
            raise AdapterRefused(
                AdapterRefused.BUSY, "this site was started without --lora-dir: no adapters"
            )
        return self.registry

    def load(self, name: str, path: str) -> None:
        """Any thread: the registry checks the files and links them in under its own lock."""
        registry = self._live()
        if name in registry.entries():
            raise AdapterRefused(AdapterRefused.EXISTS, f"adapter {name!r} is already served")
        try:
            registry.register(name, Path(path))
        except AdapterError as exc:
            raise AdapterRefused(AdapterRefused.INVALID, str(exc)) from exc

    def unload(self, name: str, scheduler: Scheduler) -> None:
        """Engine thread. Refused, not drained, while requests of `name` are live: draining
        would hold the caller for as long as the longest of them, and a refusal lets the
        operator choose (retry, or cancel them)."""
        registry = self._live()
        if name not in registry.entries():
            raise AdapterRefused(AdapterRefused.NOT_FOUND, f"adapter {name!r} is not served")
        if name in scheduler.live_adapters():
            raise AdapterRefused(
                AdapterRefused.BUSY, f"adapter {name!r} has requests queued or running; retry"
            )
        registry.unregister(name)
        scheduler.drop_adapter(name)  # unified slots: its blocks go back to the KV pool
        # Cached block ids are keyed by the adapter's name, not its weights: a later adapter of
        # this name must not reuse them. Every id goes (unloads are rare; one AllBlocksCleared).
        scheduler.clear_prefix_cache()

    def request(self, adapter: str) -> bool:
        """Whether `adapter` ("": none) is in host memory; if not, its load starts (off this
        thread) and its requests wait. RequestRejected for one this engine does not serve."""
        if not adapter:
            return True
        if self.registry is None:
            raise RequestRejected(f"adapter {adapter!r}: this site serves no LoRA adapters")
        try:
            self.registry.check_name(adapter)
        except AdapterError as exc:
            raise RequestRejected(str(exc)) from exc
        return self.registry.request(adapter)

    def settle(self, scheduler: Scheduler) -> StepOutputs:
        """Admits the requests of adapters loaded since the last step; ends with an error those
        whose adapter failed to load (a wrong base, shape or rank): their outputs."""
        outputs = StepOutputs()
        if self.registry is None or not self.registry.loading:
            return outputs
        ready, failed = self.registry.settle(scheduler.live_adapters)
        for name in ready:
            scheduler.adapter_loaded(name)
        for name, why in failed.items():
            for request_id in scheduler.awaiting_adapter(name):
                scheduler.finish(request_id, FinishReason.ERROR)
                outputs.add(request_id, finish=FinishReason.ERROR, error=why)
        return outputs

    def wait(self, seconds: float) -> None:
        """Nothing else to run: waits up to `seconds` for a load to finish."""
        if self.registry is not None:
            self.registry.wait(seconds)

    def residency(self) -> AdapterResidency:
        return self.registry.residency() if self.registry is not None else AdapterResidency()

    def close(self) -> None:
        if self.registry is not None:
            self.registry.close()
