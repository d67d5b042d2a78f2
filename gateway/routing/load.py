"""Arithmetic on a site's load that filters, scorers and MICO must agree on.

Contract: loads are compared only after division by the site's capacity weight, and a site's
free KV is its KV capacity minus its outstanding tokens (None, meaning unbounded, while the
capacity is unknown; never below zero).
"""

from __future__ import annotations

from gateway.routing.types import RoutableSite

# Loads equal up to float rounding are ties; sites then take turns instead of one always winning.
_REL_TIE = 1e-9


def normalized(tokens: float, capacity_weight: float) -> float:
    """Contract: tokens per unit of capacity; raises on a weight <= 0 (a misconfiguration that
    would otherwise silently attract or repel all traffic)."""
    if capacity_weight <= 0:
        raise ValueError(f"capacity weight must be > 0, got {capacity_weight}")
    return tokens / capacity_weight


def free_kv_tokens(site: RoutableSite) -> int | None:
    """Contract: kv_capacity_tokens - outstanding_tokens, floored at 0; None when unknown."""
    capacity = site.kv_capacity_tokens
    if capacity is None:
        return None
    return max(0, capacity - site.outstanding_tokens)


def fits(need: int, free: int | None) -> bool:
    """Contract: True when `need` tokens fit in `free` (an unknown `free` holds anything)."""
    return free is None or need <= free


def is_tie(a: float, b: float) -> bool:
    """Contract: True when a and b are equal up to float rounding (relative 1e-9)."""
    return abs(a - b) <= _REL_TIE * max(1.0, abs(a), abs(b))
