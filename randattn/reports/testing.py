"""A synthetic results table with the full schema, for tests and documentation of the figures and report.

The numbers are invented (MSE falling like 1/S, bias that does not fall, per-layer/head spread); they exercise
every code path of :mod:`randattn.reports` without running an estimator. Never report them as measurements.
"""

from __future__ import annotations

import json
from typing import Sequence

import numpy as np
import pandas as pd

from randattn.reports.tables import RESULT_COLUMNS

__all__ = ["make_results_table", "DEFAULT_LABELS"]

#: label -> (estimator, params, random, variance scale at S = 1, squared bias)
DEFAULT_LABELS: dict[str, tuple[str, dict, bool, float, float]] = {
    "softmax": ("softmax", {}, False, 0.0, 0.0),
    "rfa": ("rfa", {}, True, 4.0, 0.02),
    "rfa:coupling=orthogonal": ("rfa", {"coupling": "orthogonal"}, True, 2.5, 0.015),
    "rfa:feature_map=trigonometric": ("rfa", {"feature_map": "trigonometric"}, True, 30.0, 0.3),
    "rfa:coupling=orthogonal,feature_map=trigonometric": (
        "rfa", {"coupling": "orthogonal", "feature_map": "trigonometric"}, True, 25.0, 0.25),
    "ra": ("ra", {}, True, 0.3, 0.0),
    "lara": ("lara", {}, True, 0.8, 0.004),
    "eva": ("eva", {}, True, 0.5, 0.002),
}


def make_results_table(
    *,
    images: Sequence[str] = ("astronaut", "coffee"),
    layers: Sequence[int] = (0, 5, 11),
    heads: int = 3,
    tokens: Sequence[int] = (197, 577),
    samples: Sequence[int] = (16, 32, 64),
    labels: Sequence[str] | None = None,
    replicates: int = 8,
    model: str = "dinov2-s14",
    seed: int = 0,
) -> pd.DataFrame:
    """Invented results with every column of :data:`~randattn.reports.tables.RESULT_COLUMNS`.

    Parameters
    ----------
    images, layers : sequences
        Image names and layer indices.
    heads : int
        Heads per layer.
    tokens : sequence of int
        Token counts (one capture each).
    samples : sequence of int
        Sample counts S.
    labels : sequence of str, optional
        Keys of :data:`DEFAULT_LABELS` (all by default).
    replicates : int
        The ``replicates`` column.
    model : str
    seed : int
        Seed of the invented spread.

    Returns
    -------
    pandas.DataFrame
        One row per (tokens, image, layer, head, label, S), with ``params`` as canonical JSON.
    """
    rng = np.random.default_rng(seed)
    labels = list(DEFAULT_LABELS) if labels is None else list(labels)
    unknown = [label for label in labels if label not in DEFAULT_LABELS]
    if unknown:
        raise ValueError(f"unknown labels {unknown}; known: {', '.join(DEFAULT_LABELS)}")
    rows = []
    for n in tokens:
        for image in images:
            image_factor = rng.lognormal(0.0, 0.2)
            for layer in layers:
                for head in range(heads):
                    unit_factor = image_factor * rng.lognormal(0.0, 0.6) * (1.0 + 0.2 * layer) * (n / 197) ** 0.3
                    for label in labels:
                        estimator, params, random, scale, bias = DEFAULT_LABELS[label]
                        for s in samples:
                            variance = unit_factor * scale / s * rng.lognormal(0.0, 0.1)
                            bias_sq = unit_factor * bias * rng.lognormal(0.0, 0.1)
                            mse = variance * (replicates - 1) / replicates + bias_sq
                            rows.append({
                                "model": model, "image": image, "layer": layer, "head": head, "tokens": n,
                                "estimator": estimator, "params": json.dumps(params, sort_keys=True),
                                "label": label, "num_samples": s, "replicates": replicates, "random": random,
                                "mse": mse, "mse_se": 0.3 * mse / np.sqrt(replicates), "variance": variance,
                                "bias_sq": bias_sq - (0.0 if random else 0.0),
                                "bias_sq_naive": bias_sq + variance / replicates,
                                "bias_sq_se": 0.1 * variance / replicates, "rel_error": np.sqrt(mse) / 3.0,
                                "prob_mse": mse / 100.0,
                                "ess_mean": s * 0.5 if random else np.nan,
                                "delta_var_ratio": rng.lognormal(0.0, 0.3) if random else np.nan,
                                "pareto_khat": rng.uniform(0.1, 0.9) if random else np.nan,
                                "seconds": 1e-4 * s * n / 197, "seed": seed,
                            })
    table = pd.DataFrame(rows, columns=list(RESULT_COLUMNS))
    exact = table["estimator"] == "softmax"
    table.loc[exact, ["mse", "mse_se", "variance", "bias_sq", "bias_sq_naive", "bias_sq_se", "rel_error",
                      "prob_mse"]] = 0.0
    return table
