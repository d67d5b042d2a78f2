from __future__ import annotations

import pytest

from predictor.buckets import (
    BucketScheme,
    BucketSchemeError,
    equal_width,
    log_spaced,
    quantile,
    scheme_by_name,
)


@pytest.mark.parametrize(
    ("name", "n", "first_edges", "l_max"),
    [
        ("mico_n10_l1024", 10, (0.0, 102.4, 204.8, 307.2), 1024.0),
        ("mico_n4_l512", 4, (0.0, 128.0, 256.0, 384.0), 512.0),
        ("mico_n10_l2048", 10, (0.0, 204.8, 409.6, 614.4), 2048.0),
        ("log_n10_l1024", 10, (0.0, 16.0, 25.0, 40.0), 1024.0),
    ],
)
def test_named_schemes_have_their_edges(name, n, first_edges, l_max):
    scheme = scheme_by_name(name)
    assert scheme.name == name
    assert scheme.n_buckets == n
    assert scheme.edges[:4] == first_edges
    assert scheme.l_max == l_max


@pytest.mark.parametrize(
    ("length", "bucket"),
    [
        (0, 0),
        (102, 0),  # floor(102 / 102.4) = 0
        (103, 1),
        (204, 1),
        (205, 2),
        (512, 5),  # an edge belongs to the bucket above it
        (921, 8),
        (922, 9),
        (1023, 9),
        (1024, 9),  # l_max and beyond fall in the last bucket
        (50_000, 9),
    ],
)
def test_mico_bucket_of_matches_floor_division(length, bucket):
    scheme = equal_width(10, 1024)
    assert scheme.bucket_of(length) == bucket
    assert min(length * 10 // 1024, 9) == bucket  # exact: floats put 512 // 102.4 at 4


def test_buckets_of_is_vectorised_bucket_of():
    scheme = log_spaced()
    lengths = [0, 15, 16, 101, 102, 1023, 1024, 4000]
    assert scheme.buckets_of(lengths).tolist() == [scheme.bucket_of(n) for n in lengths]
    assert scheme.buckets_of(lengths).tolist() == [0, 0, 1, 4, 5, 9, 9, 9]


@pytest.mark.parametrize(
    ("edges", "message"),
    [
        ((0.0, 10.0), "at least 2 buckets"),
        ((1.0, 10.0, 20.0), "must start at 0"),
        ((0.0, 10.0, 10.0), "strictly increasing"),
        ((0.0, 20.0, 10.0), "strictly increasing"),
        ((0.0, 10.0, float("inf")), "non-finite"),
        ((0.0, float("nan"), 10.0), "non-finite"),
    ],
)
def test_invalid_edges_are_refused(edges, message):
    with pytest.raises(BucketSchemeError, match=message):
        BucketScheme("bad", edges)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("mico_n1_l1024", "n >= 2"),
        ("mico_n10_l5", "at least the number"),
        ("equal_10", "unknown bucket scheme"),
        ("quantile_n10", "needs training lengths"),
    ],
)
def test_bad_scheme_names_are_refused(name, message):
    with pytest.raises(BucketSchemeError, match=message):
        scheme_by_name(name)


@pytest.mark.parametrize("bad", [-1, 2.5, "3", None, True])
def test_bucket_of_refuses_non_lengths(bad):
    with pytest.raises((TypeError, ValueError)):
        equal_width().bucket_of(bad)


def test_quantile_edges_balance_the_training_lengths():
    lengths = list(range(1, 1001))
    scheme = quantile(lengths, 4)
    assert scheme.name == "quantile_n4"
    assert scheme.edges == (0.0, 251.0, 501.0, 751.0, 1001.0)
    counts = [int((scheme.buckets_of(lengths) == b).sum()) for b in range(4)]
    assert counts == [250, 250, 250, 250]


def test_quantile_merges_tied_edges():
    scheme = quantile([5] * 90 + [100] * 10, 10)
    assert scheme.edges == (0.0, 5.0, 100.0, 101.0)
    assert scheme.n_buckets == 3


def test_scheme_json_round_trip():
    scheme = equal_width(10, 1024)
    data = scheme.to_json()
    assert BucketScheme(str(data["name"]), tuple(data["edges"])) == scheme  # type: ignore[arg-type]
