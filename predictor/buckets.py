"""Length bucket schemes as data: the edges travel with the model, never hard-coded at a caller.

A scheme with edges e_0 = 0 < e_1 < ... < e_N puts a length l in bucket i when e_i <= l < e_{i+1};
lengths at or past the last edge (l_max) fall in the last bucket, since an answer can always run
longer than the scheme foresaw. MICO's equal-width scheme (label = floor(l / (l_max / N))) is the
special case e_i = i * l_max / N.
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


class BucketSchemeError(ValueError):
    """Bucket edges or a scheme name that cannot describe a partition of lengths."""


@dataclass(frozen=True, slots=True)
class BucketScheme:
    name: str
    edges: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.name:
            raise BucketSchemeError("a bucket scheme needs a name")
        if len(self.edges) < 3:
            raise BucketSchemeError(
                f"scheme {self.name!r} needs at least 2 buckets (3 edges), got {self.edges}"
            )
        if not all(math.isfinite(e) for e in self.edges):
            raise BucketSchemeError(f"scheme {self.name!r} has a non-finite edge: {self.edges}")
        if self.edges[0] != 0:
            raise BucketSchemeError(f"scheme {self.name!r} must start at 0, got {self.edges[0]}")
        if any(b <= a for a, b in zip(self.edges, self.edges[1:], strict=False)):
            raise BucketSchemeError(
                f"scheme {self.name!r} edges must be strictly increasing: {self.edges}"
            )

    @property
    def n_buckets(self) -> int:
        return len(self.edges) - 1

    @property
    def l_max(self) -> float:
        return self.edges[-1]

    def bucket_of(self, length: int) -> int:
        if isinstance(length, bool) or not isinstance(length, int | np.integer):
            raise TypeError(f"a length is a whole number of tokens, got {type(length).__name__}")
        if length < 0:
            raise ValueError(f"a length cannot be negative, got {length}")
        return min(bisect.bisect_right(self.edges, int(length)) - 1, self.n_buckets - 1)

    def buckets_of(self, lengths: Sequence[int]) -> np.ndarray:
        return np.array([self.bucket_of(length) for length in lengths], dtype=np.int64)

    def upper_edge(self, bucket: int) -> float:
        return self.edges[bucket + 1]

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "edges": list(self.edges)}


def equal_width(n: int = 10, l_max: int = 1024) -> BucketScheme:
    """MICO's scheme: N buckets of width l_max / N."""
    _check_n_l_max(n, l_max)
    width = l_max / n
    return BucketScheme(f"mico_n{n}_l{l_max}", tuple(round(i * width, 6) for i in range(n + 1)))


def log_spaced(n: int = 10, l_max: int = 1024, l_min: int = 16) -> BucketScheme:
    """[0, l_min) then N - 1 geometrically growing buckets up to l_max (short answers dominate)."""
    _check_n_l_max(n, l_max)
    if not 0 < l_min < l_max:
        raise BucketSchemeError(f"log scheme needs 0 < l_min < l_max, got {l_min}, {l_max}")
    inner = np.geomspace(l_min, l_max, n)
    return BucketScheme(f"log_n{n}_l{l_max}", (0.0, *(float(round(e)) for e in inner)))


def quantile(lengths: Sequence[int], n: int = 10) -> BucketScheme:
    """Edges at the training lengths' quantiles, so each bucket holds about 1/N of the answers.

    Tied quantiles (many answers of the same length) merge, so the scheme may have fewer than N
    buckets; the name keeps the requested N, the edges say what was possible.
    """
    if n < 2:
        raise BucketSchemeError(f"a quantile scheme needs n >= 2, got {n}")
    if len(lengths) == 0:
        raise BucketSchemeError("a quantile scheme needs training lengths")
    # "higher" picks observed lengths, never a value interpolated between two of them.
    qs = np.quantile(np.asarray(lengths), np.linspace(0, 1, n + 1)[1:-1], method="higher")
    inner = sorted({float(math.ceil(q)) for q in qs} - {0.0})
    # ceil(q) <= max(lengths), so the top edge stays above every inner one.
    return BucketScheme(f"quantile_n{n}", (0.0, *inner, float(max(lengths)) + 1.0))


_EQUAL = re.compile(r"mico_n(\d+)_l(\d+)")
_LOG = re.compile(r"log_n(\d+)_l(\d+)")
_QUANTILE = re.compile(r"quantile_n(\d+)")
SCHEME_NAMES_HELP = "mico_n<N>_l<LMAX>, log_n<N>_l<LMAX> or quantile_n<N>"


def scheme_by_name(name: str, train_lengths: Sequence[int] = ()) -> BucketScheme:
    """Builds a scheme from its name; quantile schemes need the training lengths."""
    if match := _EQUAL.fullmatch(name):
        return equal_width(int(match[1]), int(match[2]))
    if match := _LOG.fullmatch(name):
        return log_spaced(int(match[1]), int(match[2]))
    if match := _QUANTILE.fullmatch(name):
        return quantile(train_lengths, int(match[1]))
    raise BucketSchemeError(f"unknown bucket scheme {name!r}; expected {SCHEME_NAMES_HELP}")


def _check_n_l_max(n: int, l_max: int) -> None:
    if n < 2:
        raise BucketSchemeError(f"a scheme needs n >= 2 buckets, got {n}")
    if l_max < n:
        raise BucketSchemeError(f"l_max ({l_max}) must be at least the number of buckets ({n})")
