"""What the summary makes of equal columns and of cells without a finite value."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from randattn.results.summary import aggregate


def _cells(values, *, images="abc", heads=2) -> pd.DataFrame:
    """One estimator at one S, ``values[i]`` for cell i (image-major, then head), bias^2 = MSE (an exact
    estimator: variance 0)."""
    cells = [(image, head) for image in images for head in range(heads)]
    return pd.DataFrame([dict(estimator="local", label="local", num_samples=16, tokens=9, image=image, layer=0,
                              head=head, mse=value, bias_sq=value, variance=0.0)
                         for (image, head), value in zip(cells, values)])


def test_equal_columns_get_equal_intervals():
    """An exact estimator's MSE is its bias^2 in every cell: the summary printed two intervals for the one number
    (0.0135-0.0323 against 0.0127-0.0321 on a DINOv2 table), its bootstrap stream drawn on from metric to metric."""
    values = np.random.default_rng(3).exponential(size=16)
    row = aggregate(_cells(values, images="abcdefgh"), n_boot=500, seed=1).iloc[0]
    assert (row["mse"], row["mse_lo"], row["mse_hi"]) == (row["bias_sq"], row["bias_sq_lo"], row["bias_sq_hi"])
    assert row["mse_lo"] < row["mse"] < row["mse_hi"]


def test_a_cell_without_a_value_is_not_dropped_from_its_mean():
    """Three images of two heads: a NaN cell made its image's mean the other head's alone, and the summary 0.2786
    where the mean of the measured cells is 0.2788, with an interval and the same count of units. The mean and the
    interval are NaN now; an inf cell gives an inf mean, where its interval dropped it (inf [0.172, 0.407])."""
    values = [1.0, 3.0, 2.0, 6.0, 4.0, 8.0]  # image means 2, 4, 6
    whole = aggregate(_cells(values), n_boot=200).iloc[0]
    assert whole["mse"] == 4.0 and whole["units"] == 3
    for bad, expected in ((math.nan, math.nan), (math.inf, math.inf)):
        row = aggregate(_cells([bad, *values[1:]]), n_boot=200).iloc[0]
        assert row["mse"] == expected or (math.isnan(expected) and math.isnan(row["mse"]))
        assert math.isnan(row["mse_lo"]) and math.isnan(row["mse_hi"]) and row["units"] == 3
        assert row["variance"] == 0.0 and row["variance_lo"] == 0.0  # the other columns are untouched
