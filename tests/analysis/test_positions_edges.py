"""Explicit position-bucket edges start at 1, so that every query falls in a bucket.

Edges such as ``8161`` left the queries at positions 1 to 8160 in no bucket without a word, and ``100000`` on a
shorter run gave no per-position rows at all; both are refused where the edges are read, in Python as on the
command line."""

from __future__ import annotations

import numpy as np
import pytest

from randattn.analysis.plan import SweepConfig, parse_estimator_list
from randattn.analysis.positions import bucket_query_slices, parse_position_buckets, position_buckets


def _first_edge_message(shown: str, fixed: str, name: str = "position buckets") -> str:
    return (f"{name} {shown}: the first lower edge must be 1, so that every query falls in a bucket (positions "
            f"start at 1, and those below the first edge would be in none); use {fixed}")


@pytest.mark.parametrize(("value", "shown", "fixed"), [
    ("8161", "'8161'", "1,8161"),
    ("100000", "'100000'", "1,100000"),
    ("2,4,8", "'2,4,8'", "1,2,4,8"),
    ((4, 64), "(4, 64)", "1,4,64"),
    ([8161], "[8161]", "1,8161"),
])
def test_edges_whose_first_is_not_1_are_refused_naming_them_and_the_fix(value, shown, fixed):
    with pytest.raises(ValueError) as caught:
        parse_position_buckets(value)
    assert str(caught.value) == _first_edge_message(shown, fixed)


def test_the_message_names_what_the_caller_calls_the_edges():
    with pytest.raises(ValueError) as caught:
        parse_position_buckets("8161", name="--position-buckets")
    assert str(caught.value) == _first_edge_message("'8161'", "1,8161", "--position-buckets")


@pytest.mark.parametrize("value", ["4,2", "0,4", "1,1", "1,x", ""])
def test_malformed_edges_keep_their_message(value):
    with pytest.raises(ValueError, match=f"position buckets {value!r}: use log2, none, auto or strictly increasing"):
        parse_position_buckets(value)


def test_edges_from_1_and_the_named_schemes_are_accepted():
    assert parse_position_buckets("1,8161") == (1, 8161)
    assert parse_position_buckets(" 1, 2 ,4 ") == (1, 2, 4)
    assert parse_position_buckets((1, 100000)) == (1, 100000)
    assert [parse_position_buckets(name) for name in ("auto", "none", "log2", "LOG2")] == ["auto", "none", "log2",
                                                                                             "log2"]


def test_the_python_api_applies_the_same_rule():
    ra = parse_estimator_list("ra")
    with pytest.raises(ValueError, match="position buckets '8161': the first lower edge must be 1"):
        SweepConfig(estimators=ra, num_samples=(4,), position_buckets="8161")
    with pytest.raises(ValueError, match=r"position buckets \(2, 4\): the first lower edge must be 1"):
        position_buckets((2, 4), 10)
    assert SweepConfig(estimators=ra, num_samples=(4,), position_buckets=(1, 8161)).position_buckets == (1, 8161)


@pytest.mark.parametrize("edges", [(1,), (1, 8161), (1, 100000), (1, 4), (1, 2, 4, 8, 64)])
@pytest.mark.parametrize(("num_queries", "num_keys"), [(11, 11), (5, 11), (1, 1)])
def test_every_query_falls_in_exactly_one_bucket(edges, num_queries, num_keys):
    """With a first edge of 1 and an open last bucket, the buckets' slices tile every measured query."""
    slices = bucket_query_slices(edges, num_queries, num_keys)
    covered = np.concatenate([np.arange(num_queries)[s] for _, _, s in slices])
    assert covered.tolist() == list(range(num_queries))
