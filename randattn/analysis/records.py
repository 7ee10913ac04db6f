"""What a sweep's table records about itself: its metadata sidecar and the float64 reference check.

Kept in the library, not the command line, so that a Python caller writing a table
(:func:`randattn.results.write_tables`) can record the same metadata as ``randattn mse``.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any, Sequence

__all__ = [
    "ACTIVATION_FIELDS",
    "EXACT_CELL_RTOL",
    "REFERENCE_TOLERANCE",
    "activations_fingerprint",
    "command_line",
    "reference_check_summary",
    "query_record",
    "resume_command",
    "table_metadata",
]

#: activation-file metadata copied into the table's: what the report names; a language-model capture's fields
#: (architecture, kv_heads, mask, ...) let it add its LM section. Absent fields are stored as None.
ACTIVATION_FIELDS = ("model", "layers", "heads", "head_dim", "tokens", "images", "scale", "source", "layout",
                     "architecture", "kv_heads", "head_map", "mask", "sliding_window", "weights", "text", "add_bos")

#: a batched result deviating from the reference by more than this fraction of the cell's RMSE is flagged:
#: its rounding would then move the measured MSE by more than ~2 %
REFERENCE_TOLERANCE = 0.01
#: a checked cell whose float64 reference is within this of exact softmax, relative to the largest exact output
#: entry, is exact: the agreement randattn holds every batched form to against its reference (ARCHITECTURE sec. 3),
#: so that no number of the table could tell the two apart
EXACT_CELL_RTOL = 1e-10


def command_line(argv: Sequence[str]) -> str:
    """``argv`` as a shell command starting with ``randattn``, each argument quoted where needed.

    Parameters
    ----------
    argv : sequence of str
        The arguments after the program name (``sys.argv[1:]``).
    """
    return " ".join(shlex.quote(str(arg)) for arg in ["randattn", *argv])


def resume_command(argv: Sequence[str]) -> str:
    """Deprecated: the command line's own (``randattn.cli._errors.resume_command``), which words its options.

    The command that continues the run of ``argv``: without its flags that start afresh, with the one that resumes.

    Parameters
    ----------
    argv : sequence of str
        The interrupted run's arguments after the program name (``sys.argv[1:]``).
    """
    import warnings

    warnings.warn("randattn.analysis.records.resume_command is deprecated: the command that continues a run is the "
                  "command line's, randattn.cli._errors.resume_command", DeprecationWarning, stacklevel=2)
    kept = [a for a in argv if a not in ("--overwrite", "--force", "--dry-run")]
    if "--resume" not in kept:
        kept.append("--resume")
    return command_line(kept)


def reference_check_summary(table) -> dict | None:
    """The largest |batched - reference| over the checked units, per dtype, and the largest ratio of a checked cell's
    deviation to its RMSE.

    The ratio says how far the run's rounding can move a measured MSE: the root mean square of the cell's deviation
    (``ref_rms_dev``) over its RMSE, r, moves the MSE by at most ``2 r + r^2`` relative (Cauchy-Schwarz;
    :func:`~randattn.analysis.execute.rms_deviation`); a table written before that column gives its largest entry
    (``ref_max_abs_dev``), a bound as loose as one entry is unlike the rest (``dev_over_rmse_of`` says which). It
    leaves out the cells whose estimate is exact, whose RMSE is rounding itself, so that any deviation is many times
    it and says nothing about the table: those of an estimator whose spec declares it exact (``convergence == "exact"``, e.g. softmax), those where the
    float64 reference itself equals exact softmax to :data:`EXACT_CELL_RTOL` (``ref_max_rel_err``: MagicPIG or
    vAttention whose sinks and local keys cover every key, any estimator under a window of one key), and, in a table
    written before that column, those where a deterministic selection reads every key its queries see
    (``keys_fraction`` 1: top-k, StreamingLLM or Quest with S >= the visible keys). Their deviation still enters
    ``max_abs_dev``.

    Parameters
    ----------
    table : pandas.DataFrame
        A sweep's table; the units re-run on the float64 reference have a ``ref_max_abs_dev`` that is not NaN
        (infinite where one form gave a non-finite value the other did not).

    Returns
    -------
    dict or None
        None when no unit was checked. The ratio's entries are None when every checked estimator is exact;
        otherwise ``above_tolerance_dtypes`` lists the dtypes of the units whose ratio exceeds the tolerance.
        ``non_finite: True`` (and ``max_abs_dev`` None) where a checked unit's forms disagreed on a non-finite
        value; ``max_abs_dev_label`` names its estimator.
    """
    import numpy as np
    import pandas as pd

    from randattn.analysis.relative_error import MEASUREMENT_KEYS, s_free_repeats

    # NaN: not checked; inf: checked, and a form gave a non-finite value where the other did not
    checked = table[table["ref_max_abs_dev"].notna()] if "ref_max_abs_dev" in table else table.iloc[:0]
    if not len(checked):
        return None
    # a configuration without S: one check, its row repeated at each S
    checked = checked[~s_free_repeats(checked, MEASUREMENT_KEYS)[1]]
    worst = checked.loc[checked["ref_max_abs_dev"].idxmax()]
    summary = {
        "units_checked": int(len(checked)),
        "max_abs_dev": float(worst["ref_max_abs_dev"]),
        "max_abs_dev_label": str(worst["label"]),
        "max_dev_over_rmse": None,
        "max_dev_over_rmse_label": None,
        "max_dev_over_rmse_dtype": None,
        "tolerance_dev_over_rmse": REFERENCE_TOLERANCE,
    }
    if not np.isfinite(summary["max_abs_dev"]):
        # a form gave NaN or inf where the other did not: no deviation to state (null in the metadata's JSON), and
        # the estimator that did it named
        return {**summary, "max_abs_dev": None, "non_finite": True}
    declared_exact = np.array([_declared_exact(name, params)
                               for name, params in zip(checked["estimator"], checked["params"])], dtype=bool)
    reads_every_key = (checked["keys_fraction"].ge(1.0) & ~checked["random"].astype(bool)).to_numpy(dtype=bool) \
        if {"keys_fraction", "random"} <= set(checked.columns) else np.zeros(len(checked), dtype=bool)
    exact_cell = (checked["ref_max_rel_err"].le(EXACT_CELL_RTOL).to_numpy(dtype=bool) if "ref_max_rel_err" in checked
                  else np.zeros(len(checked), dtype=bool))
    inexact = checked[~declared_exact & ~reads_every_key & ~exact_cell]
    if len(inexact):
        rms = inexact["ref_rms_dev"] if "ref_rms_dev" in inexact else pd.Series(np.nan, index=inexact.index)
        deviation = rms.where(rms.notna(), inexact["ref_max_abs_dev"])
        # an MSE that is NaN (the estimate was) makes the ratio as large as it gets, not a NaN that idxmax skips
        ratio = (deviation / np.sqrt(inexact["mse"].clip(lower=1e-300))).fillna(np.inf)
        worst_ratio = inexact.loc[ratio.idxmax()]
        summary.update(max_dev_over_rmse=float(ratio.max()), max_dev_over_rmse_label=str(worst_ratio["label"]),
                       max_dev_over_rmse_dtype=str(worst_ratio["dtype"]),
                       dev_over_rmse_of="rms" if pd.notna(rms[ratio.idxmax()]) else "max",
                       # which dtypes ran the units above the tolerance: --dtype float64 can only help the others
                       above_tolerance_dtypes=sorted(set(map(str, inexact["dtype"][ratio > REFERENCE_TOLERANCE]))))
    return summary


def _declared_exact(name: str, params: str) -> bool:
    """Whether estimator ``name`` with the table's ``params`` (JSON) declares itself exact; False for one not
    registered here (a plugin that is not installed: its ratio is kept, as before specs were read)."""
    from randattn.estimators.registry import get_spec

    try:
        spec = get_spec(name)
        return spec.convergence_of(spec.resolve_params(json.loads(params))) == "exact"
    except (KeyError, ValueError, TypeError):
        return False


def table_metadata(config, activations, out: str | Path, table, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """The metadata written beside a sweep's table (``<out>.meta.json`` and, for Parquet, into the file).

    Parameters
    ----------
    config : SweepConfig
    activations : Activations
        Their metadata's :data:`ACTIVATION_FIELDS` are copied.
    out : path
        The table's path, recorded.
    table : pandas.DataFrame
        The sweep's table: its warnings and timing (``attrs``) and reference check are recorded.
    argv : sequence of str, optional
        The command line (default ``sys.argv``).

    Returns
    -------
    dict
    """
    from importlib.metadata import PackageNotFoundError, version

    argv = list(sys.argv if argv is None else argv)
    try:
        randattn_version = version("randattn")
    except PackageNotFoundError:  # a source tree that is not installed
        randattn_version = "unknown"
    return {
        "command_line": command_line(argv[1:]) if argv else None,
        "argv": argv,
        "seed": config.seed,
        "randattn_version": randattn_version,
        "config": config.to_json(),
        "activations": {k: activations.metadata.get(k) for k in ACTIVATION_FIELDS},
        "config_identity": config.identity(),
        "activations_fingerprint": activations_fingerprint(activations),
        # the mask every layer was measured under (None: bidirectional; {"<layer>": kind} when they differ)
        "mask": config.mask_json(),
        "queries": query_record(config, activations),
        "epsilon": config.epsilon,
        "columns_doc": "see randattn.analysis.sweep.COLUMNS",
        "output": str(out),
        "warnings": table.attrs.get("warnings", []),
        "reference_check": reference_check_summary(table),
        "timing": table.attrs.get("timing"),
        "compute": compute_record(config, table),
    }


def activations_fingerprint(acts) -> dict[str, Any]:
    """What identifies the activations a run measures: shape, layers, images, model, scale and the arrays' SHA-256
    (:attr:`~randattn.activations.io.Activations.digest`), so that a capture changed in its numbers alone is not
    resumed as the same run (its parts' manifest and its table's metadata hold it)."""
    return {"shape": list(acts.shape), "layers": list(acts.layers), "images": list(acts.images),
            "model": acts.metadata.get("model"), "scale": acts.scale, "digest": acts.digest}


def query_record(config, activations) -> dict[str, Any]:
    """Which query rows the sweep measured (:mod:`randattn.analysis.queries`): the selection as written, the rows
    (None for every row) and, for a sample, the master seed its generator is derived from
    (:func:`~randattn.analysis.queries.query_sample_seed`)."""
    rows = config.query_rows(int(activations.shape[2]))
    kind = config.queries.split(":")[0]
    return {"selection": config.queries, "of": int(activations.shape[2]),
            "rows": None if rows is None else [int(r) for r in rows],
            "sample_seed": config.seed if kind == "sample" else None}


def compute_record(config, table) -> dict[str, Any]:
    """Where and in what precision a sweep's numbers were computed: backend, device (and GPU name), torch version,
    the dtypes the rows were estimated in, and the float32 matrix-product precision randattn enforced.

    Parameters
    ----------
    config : SweepConfig
    table : pandas.DataFrame
        The sweep's table; its ``dtype`` column gives the dtypes used (``dtype="auto"`` mixes them).
    """
    dtypes = sorted(set(map(str, table["dtype"]))) if "dtype" in table else []
    if config.backend == "reference":
        return {"backend": "reference", "device": "cpu", "dtype": "float64", "dtypes": dtypes,
                "float32_matmul": None}
    from randattn._precision import compute_environment

    return {"backend": "torch", **compute_environment(config.device), "dtype": config.dtype, "dtypes": dtypes,
            "threads": config.threads}
