"""A synthetic results table with the full schema, for tests and documentation of the figures and report.

The numbers are invented (MSE falling like 1/S, bias that does not fall, per-layer/head spread); they exercise
every code path of :mod:`randattn.reports` without running an estimator. Never report them as measurements.
"""

from __future__ import annotations

import json
from typing import Mapping, Sequence

import numpy as np
import pandas as pd

from randattn.reports.tables import RESULT_COLUMNS, estimator_spec, is_exact, row_params

__all__ = ["make_results_table", "DEFAULT_LABELS"]

#: label -> (estimator, params, variance scale at S = 1, squared bias): the invented profile of each label the
#: synthetic table can hold (configuration, not facts: whether a label is random or exact is asked of its spec)
DEFAULT_LABELS: dict[str, tuple[str, dict, float, float]] = {
    "softmax": ("softmax", {}, 0.0, 0.0),
    "rfa": ("rfa", {}, 4.0, 0.02),
    "rfa:coupling=orthogonal": ("rfa", {"coupling": "orthogonal"}, 2.5, 0.015),
    "rfa:feature_map=trigonometric": ("rfa", {"feature_map": "trigonometric"}, 30.0, 0.3),
    "rfa:coupling=orthogonal,feature_map=trigonometric": (
        "rfa", {"coupling": "orthogonal", "feature_map": "trigonometric"}, 25.0, 0.25),
    "ra": ("ra", {}, 0.3, 0.0),
    "lara": ("lara", {}, 0.8, 0.004),
    "eva": ("eva", {}, 0.5, 0.002),
}


def _is_random(estimator: str, params: dict) -> bool:
    """The spec's ``is_random``; an estimator not registered here is taken as random (a plugin's rows)."""
    spec = estimator_spec(estimator)
    return True if spec is None else bool(spec.is_random(row_params(spec, params)))


def make_results_table(
    *,
    images: Sequence[str] = ("astronaut", "coffee"),
    layers: Sequence[int] = (0, 5, 11),
    heads: int = 3,
    tokens: Sequence[int] = (197, 577),
    samples: Sequence[int] = (16, 32, 64),
    labels: Sequence[str] | None = None,
    profiles: Mapping[str, tuple[str, dict, float, float]] | None = None,
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
        Keys of :data:`DEFAULT_LABELS` or ``profiles`` (all of :data:`DEFAULT_LABELS` by default).
    profiles : mapping, optional
        More labels, as in :data:`DEFAULT_LABELS` (e.g. a plugin estimator's); they take precedence.
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
    known = {**DEFAULT_LABELS, **dict(profiles or {})}
    labels = list(DEFAULT_LABELS) if labels is None else list(labels)
    unknown = [label for label in labels if label not in known]
    if unknown:
        raise ValueError(f"unknown labels {unknown}; known: {', '.join(known)}")
    random_of = {label: _is_random(*known[label][:2]) for label in labels}
    rows = []
    for n in tokens:
        for image in images:
            image_factor = rng.lognormal(0.0, 0.2)
            for layer in layers:
                for head in range(heads):
                    unit_factor = image_factor * rng.lognormal(0.0, 0.6) * (1.0 + 0.2 * layer) * (n / 197) ** 0.3
                    for label in labels:
                        estimator, params, scale, bias = known[label]
                        random = random_of[label]
                        for s in samples:
                            variance = unit_factor * scale / s * rng.lognormal(0.0, 0.1)
                            bias_sq = unit_factor * bias * rng.lognormal(0.0, 0.1)
                            mse = variance * (replicates - 1) / replicates + bias_sq
                            rows.append({
                                "model": model, "image": image, "layer": layer, "head": head, "tokens": n,
                                "mask": "none", "estimator": estimator, "params": json.dumps(params, sort_keys=True),
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
    # an exact estimator's error is round-off: zero here, as the figures expect of it
    exact = table["label"].isin([label for label in labels if is_exact(*known[label][:2])])
    table.loc[exact, ["mse", "mse_se", "variance", "bias_sq", "bias_sq_naive", "bias_sq_se", "rel_error",
                      "prob_mse"]] = 0.0
    return table
