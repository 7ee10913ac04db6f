"""``randattn.testing.assert_close_to_rounding``: the column rule the golden-table test and the GPU sweep test share.

The case it exists for, as measured on an H100: a float64 MSE column holds random estimators' errors (~1e-1) beside
softmax's, which is float64 rounding itself (~5e-33) and moved 30 % between CPU and GPU summation orders.
"""

from __future__ import annotations

import numpy as np
import pytest

from randattn.testing import ROUNDING_FLOOR, assert_close_to_rounding

CPU = np.array([0.12, 3.4e-2, 5.0e-33, np.nan])


def test_rounding_rows_may_move_by_tens_of_percent():
    gpu = CPU * np.array([1 + 1e-12, 1 - 1e-12, 1.3, 1.0])
    assert_close_to_rounding(gpu, CPU, rtol=1e-9)
    # the rule it replaces (relative only) refused this very column: the failure seen on the GPU
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(gpu, CPU, rtol=1e-9, atol=0)


def test_the_estimators_rows_are_still_held_to_rtol():
    moved = CPU * np.array([1 + 1e-8, 1.0, 1.0, 1.0])  # 1e-8 relative: 1.2e-9 absolute, far above the 1.2e-15 floor
    with pytest.raises(AssertionError):
        assert_close_to_rounding(moved, CPU, rtol=1e-9)


def test_the_floor_is_relative_to_the_columns_largest_value():
    scaled = CPU * 1e6  # the same column in other units: the same verdicts
    assert_close_to_rounding(scaled * np.array([1.0, 1.0, 1.3, 1.0]), scaled, rtol=1e-9)
    small = np.array([1e-20, 0.0])  # a floor of 1e-14 x 1e-20 = 1e-34: an absolute 1e-30 is far above it
    with pytest.raises(AssertionError):
        assert_close_to_rounding(np.array([1e-20, 1e-30]), small, rtol=1e-9)
    assert ROUNDING_FLOOR == 1e-14


def test_non_finite_entries_must_match_in_place():
    with pytest.raises(AssertionError):
        assert_close_to_rounding(np.array([0.12, 3.4e-2, 5.0e-33, 0.0]), CPU, rtol=1e-9)
    with pytest.raises(AssertionError):
        assert_close_to_rounding(np.array([0.12, np.inf, 5.0e-33, np.nan]), CPU, rtol=1e-9)


def test_an_explicit_floor_replaces_the_column_relative_one():
    column = np.array([1.0, 1e-16])
    assert_close_to_rounding(np.array([1.0, 5e-13]), column, rtol=1e-10, floor=1e-12)
    with pytest.raises(AssertionError):
        assert_close_to_rounding(np.array([1.0, 5e-13]), column, rtol=1e-10)
