"""Which running LoRA adapter gives up its device slot to a waiting request that has none
(site_engine/engine/core/scheduling/adapter_gate.py admits; issue 61's LoRA mix found the
starvation this prevents). Pure Python.

With max_loras distinct adapters running, a waiting request for another adapter cannot be
admitted. If later requests for the running adapters were admitted past it, a steadily used
adapter would never drain and the waiting one would wait forever. Mostly some adapter drains on
its own soon, so such a request is overtaken for adapter_overtake_steps steps (counted from the
first step it found every slot taken); then one running adapter is drained for it: its new
requests behind that request, in the same class or a lower one, wait (its running ones keep
decoding) until it runs no more and its slot goes to the first request in order that needs
one. Only that adapter is held back: the others' requests and base-model ones do not keep the
slot taken and go on being admitted (holding back every adapter, as strict FCFS would, idles
the whole batch to free one slot).

After the overtaking steps, the wait is bounded by the drained adapter's running sequences
finishing: the one chosen expects the fewest tokens to its last running sequence's end, then
holds back the fewest waiting requests. An adapter running a sequence of a class above the
waiting request's is chosen last: that class's requests are never held back for a lower class,
so it may not drain. The choice is kept while its adapter runs, so that the draining is not
spread over adapters that each keep their slot.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from fedllm_contract.priority import Priority
from site_engine.engine.core.sequence import Sequence


def outranked(running: Iterable[Sequence], adapter: str, priority: Priority) -> bool:
    """Whether a running sequence of `adapter` is of a class above `priority`."""
    return any(seq.adapter == adapter and seq.priority < priority for seq in running)


def adapter_to_drain(
    running: Iterable[Sequence], priority: Priority, behind: Iterable[Sequence]
) -> str:
    """Of the adapters of `running` (at least one), the one to drain for a waiting request of
    class `priority` that has no slot; `behind`: the waiting requests after it in order, of
    which those of the chosen adapter are held back."""
    above: set[str] = set()
    longest: dict[str, int] = {}
    for seq in running:
        if not seq.adapter:
            continue
        if seq.priority < priority:
            above.add(seq.adapter)
        remaining = seq.remaining_predicted_tokens
        longest[seq.adapter] = max(longest.get(seq.adapter, 0), remaining)
    if not longest:
        raise ValueError("no running sequence uses an adapter")
    held = Counter(seq.adapter for seq in behind if seq.adapter in longest)
    return min(longest, key=lambda a: (a in above, longest[a], held[a], a))
