"""The adapter gate: whether a waiting request's LoRA adapter lets it be admitted now, asked once
per candidate that has an adapter, and the draining that keeps such a request from waiting
forever.

The running sequences use at most max_loras distinct adapters. A waiting request whose adapter
has no slot is passed over like one whose grammar compiles, but for at most
adapter_overtake_steps steps: then one running adapter drains for it (adapter_slots.py), that
adapter's requests behind it in order waiting so that its slot frees, while the other adapters'
and base requests go on. With config.adapter_blocks > 0 the slots come out of the KV block pool
(unified_slots.py): an adapter is made resident when a request of it is admitted or waits near
the head (prefetch), idle adapters give their blocks back before any sequence is preempted or
refused for blocks, and max_loras only caps how many are resident.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from collections.abc import Sequence as Seq
from itertools import islice

from site_engine.engine.core.adapter_slots import adapter_to_drain, outranked
from site_engine.engine.core.scheduling.roster import Roster
from site_engine.engine.core.sequence import Sequence

# The gate's answers besides "admit, with this many blocks for the adapter": pass this candidate
# over (those behind it go on), or stop the class's admissions here (as for one that does not fit).
SKIP = -1
STOP = -2


class AdapterGate:
    """Answers for a candidate's adapter; keeps the adapter drained for one that waits."""

    def __init__(self, roster: Roster) -> None:
        self._roster = roster
        # The running adapter being drained for a waiting request that has no adapter slot
        # (adapter_slots.py), kept across steps while it runs; `_hold` is it in the step being
        # planned once such a request was met (None before: nobody is held back yet).
        self._drain: str | None = None
        self._hold: str | None = None
        self._step_id = 0

    def begin_step(self, step_id: int) -> None:
        self._hold = None
        self._step_id = step_id

    def answer(self, seq: Sequence, candidates: Seq[Sequence], index: int) -> int:
        """For `seq`, `candidates[index]`, which has an adapter: the KV blocks its adapter
        takes if admitted (unified slots: its adapter, idle until now, made resident), SKIP
        or STOP."""
        roster = self._roster
        running = roster.running_adapters.keys()
        adapter = seq.adapter
        if adapter == self._hold:
            return SKIP  # behind a request that waits for this adapter's slot
        slots = roster.slots
        if self._ready(seq, running):
            return slots.blocks_per_adapter if slots is not None and adapter not in running else 0
        under_cap = len(running) < roster.config.max_loras
        if slots is not None and not seq.awaiting_adapter and under_cap:
            return STOP  # only its adapter's blocks are missing: as a sequence that does not fit
        # As for a grammar, the requests behind it go on, but for one adapter's: while it waits
        # for a slot, that adapter drains and gives its slot up.
        if not seq.awaiting_adapter and self._overtaken_enough(seq):
            self._hold_adapter(seq, running, islice(candidates, index + 1, None))
        return SKIP

    def _ready(self, seq: Sequence, running: Collection[str]) -> bool:
        """Whether `seq`'s adapter is in host memory and has a device slot to go to: the
        running sequences use at most max_loras distinct adapters, one step's worth."""
        if seq.awaiting_adapter:
            return False
        if seq.adapter in running:
            return True
        roster = self._roster
        if len(running) >= roster.config.max_loras:
            return False
        if roster.slots is None:
            return True
        return roster.slots.take(seq.adapter, running, roster.adapter_demand)

    def _overtaken_enough(self, seq: Sequence) -> bool:
        """Whether `seq`, which finds every adapter slot taken, has been overtaken for
        adapter_overtake_steps steps (counted from the first step it found them taken) and
        nobody is held back for it yet in this step."""
        if seq.slot_wait_since < 0:
            seq.slot_wait_since = self._step_id
        waited = self._step_id - seq.slot_wait_since
        return self._hold is None and waited >= self._roster.config.adapter_overtake_steps

    def _hold_adapter(
        self, seq: Sequence, running: Collection[str], behind: Iterable[Sequence]
    ) -> None:
        """`seq` waits for an adapter slot (all max_loras are `running`): hold back the new
        requests of the adapter being drained, chosen anew unless the last choice still runs
        and is not kept running by a class above `seq`'s."""
        drain, sequences = self._drain, self._roster.running
        if drain is None or drain not in running or outranked(sequences, drain, seq.priority):
            drain = adapter_to_drain(sequences, seq.priority, behind)
        self._drain = self._hold = drain

    def end_step(self) -> None:
        """The step is planned: unified slots are touched and prefetched; with nobody waiting
        for a slot, a drained adapter that no longer runs is chosen anew."""
        roster = self._roster
        if roster.slots is not None:
            roster.slots.touch(roster.running_adapters.keys())
            self._prefetch()
        drain = self._drain
        if drain is not None and self._hold is None:
            self._drain = drain if any(seq.adapter == drain for seq in roster.running) else None

    def _prefetch(self) -> None:
        """The adapters of the first waiting requests (in admission order, loaded in host
        memory) take their blocks while the pool keeps the watermark and the request's own
        blocks free: their weights are written before their requests run. A prefetched adapter
        is idle, so the first to give its blocks back if sequences need them."""
        roster = self._roster
        slots = roster.slots
        assert slots is not None
        watermark = roster.config.watermark_blocks
        for seq in islice(roster.waiting, slots.cap):
            if not seq.adapter or seq.awaiting_adapter:
                continue
            keep = watermark + roster.blocks.blocks_needed(seq.num_tokens)
            if not slots.prefetch(seq.adapter, keep):
                break

    def adapter_loaded(self, adapter: str) -> None:
        """`adapter` is in host memory: the requests that wait for it may be admitted."""
        for seq in self._roster.waiting:
            if seq.adapter == adapter:
                seq.awaiting_adapter = False

    def awaiting_adapter(self, adapter: str) -> list[str]:
        """The requests waiting for `adapter` to load."""
        waiting = self._roster.waiting
        return [s.request_id for s in waiting if s.adapter == adapter and s.awaiting_adapter]

    def evict_idle_adapters(self) -> int:
        """Unified slots: every idle adapter gives its blocks back (before the cache's top is
        lent: kv_lending.py lends only free blocks, and an adapter's may sit there); how many."""
        evicted = 0
        while self._roster.evict_idle_adapter(()):
            evicted += 1
        return evicted
