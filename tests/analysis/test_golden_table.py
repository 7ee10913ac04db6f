"""A fixed sweep's tables, stored (``tests/data/golden-sweep.*``), against the engine of today: refactors of the
engine (plan, execute, executors, store) must leave them unchanged.

Bit for bit where the tables were made (the fingerprint in ``golden-sweep.json``: CPU model, the SIMD kernels
torch and numpy chose for it, the kernels numpy's OpenBLAS chose, torch, numpy and Python versions; "the same seed gives the same numbers, bit for bit,
on the same machine"; a virtual machine may report one CPU model for hosts of different vector widths, hence the
kernels); elsewhere, where other kernels may group float64 sums differently, to 1e-10 relative (float64 summation
order alone moves a value by ~1e-15 relative per operation; ARCHITECTURE sec. 3), plus an absolute floor of
1e-14 of the column's largest value: an exact estimator's squared error is float64 rounding itself (softmax's MSE
is ~1e-33 where random estimators' are ~1e-1), which any change of summation order moves by 100 %. A draw change that moves the numbers on purpose
regenerates the file (``python tests/analysis/test_golden_table.py --regenerate``) and says so in CHANGELOG.md.

The sweep: every built-in estimator at S = 4, 8 (RA, LARA and EVA with their defaults; RFA iid and orthogonal),
R = 3, float64, probabilities and diagnostics on, one bidirectional layer and one causal layer (per-position
rows), 2 images x 2 heads x 12 tokens, seed 17.
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from randattn.testing import assert_close_to_rounding as column_close_to_rounding

DATA = Path(__file__).resolve().parents[1] / "data"
TABLE, POSITIONS, FINGERPRINT = (DATA / f"golden-sweep.{ext}" for ext in ("table.parquet", "positions.parquet",
                                                                          "json"))
BIDIRECTIONAL = "softmax;rfa;rfa:coupling=orthogonal;ra;lara;eva;local;scatterbrain"
CAUSAL = "softmax;rfa;rfa:coupling=orthogonal;ra;eva;local"
#: columns that measure the run, not the attention: wall-clock seconds
VOLATILE = ("seconds",)
#: columns that measure float64 rounding itself (batched against reference, ~1e-16 on O(1) outputs): compared
#: with an absolute tolerance far below the 1e-10 agreement they check and far above rounding
ROUNDING = {"ref_max_abs_dev": 1e-12}


def _fingerprint() -> dict:
    import torch

    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    simd = _numpy_simd()
    return {"cpu": cpu, "machine": platform.machine(), "python": platform.python_version(), "torch": torch.__version__,
            "numpy": np.__version__, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "numpy_simd": simd, "openblas_core": _openblas_core()}


def _openblas_core() -> str | None:
    """The kernels numpy's OpenBLAS chose at load (a DYNAMIC_ARCH build picks Haswell, SkylakeX, Zen, ... from the
    CPU): two hosts of one CPU model name and the same SIMD flags chose differently, and LAPACK's QR, which
    orthogonal features use, rounded their draws apart in the last bit. None where numpy has no such OpenBLAS."""
    import ctypes
    import glob
    import os

    for path in glob.glob(os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs", "*openblas*")):
        try:
            corename = ctypes.CDLL(path).scipy_openblas_get_corename64_
        except (OSError, AttributeError):
            continue
        corename.restype = ctypes.c_char_p
        return corename().decode()
    return None


def _numpy_simd() -> list[str]:
    """The SIMD extensions numpy found on this CPU (its dispatched kernels depend on them)."""
    from numpy._core._multiarray_umath import __cpu_features__

    return sorted(name for name, found in __cpu_features__.items() if found)


def _sweep() -> tuple[pd.DataFrame, pd.DataFrame]:
    from randattn.activations import make_activations
    from randattn.analysis.plan import SweepConfig, parse_estimator_list
    from randattn.analysis.sweep import run_sweep_tables

    rng = np.random.default_rng(2026)
    arrays = {layer: tuple(rng.normal(size=(2, 2, 12, 8)) for _ in range(3)) for layer in (0, 1)}
    acts = make_activations(arrays, {"scale": 0.3, "model": "golden", "images": ["a", "b"]})
    tables = []
    for layer, mask, names in ((0, None, BIDIRECTIONAL), (1, "causal", CAUSAL)):
        config = SweepConfig(estimators=parse_estimator_list(names), num_samples=(4, 8), replicates=3, seed=17,
                             dtype="float64", layers=(layer,), mask=mask, threads=1)
        tables.append(run_sweep_tables(acts, config))
    table = pd.concat([t.table for t in tables], ignore_index=True)
    positions = pd.concat([t.positions for t in tables if t.positions is not None], ignore_index=True)
    return table, positions


def test_a_fixed_sweep_gives_the_stored_tables():
    table, positions = _sweep()
    stored = json.loads(FINGERPRINT.read_text())
    same_machine = stored == _fingerprint()
    for got, path in ((table, TABLE), (positions, POSITIONS)):
        expected = pd.read_parquet(path).drop(columns=list(VOLATILE), errors="ignore")
        got = got.drop(columns=list(VOLATILE), errors="ignore")
        # columns added since the file was made are appended: the stored ones keep their places and values
        assert list(got.columns)[: len(expected.columns)] == list(expected.columns), path.name
        got = got[list(expected.columns)]
        if same_machine:
            pd.testing.assert_frame_equal(got.reset_index(drop=True), expected, check_exact=True, obj=path.name)
        else:
            assert_close_to_rounding(got.reset_index(drop=True), expected, path.name)


def assert_close_to_rounding(got: pd.DataFrame, expected: pd.DataFrame, name: str) -> None:
    """Float columns to 1e-10 relative plus 1e-14 of the column's largest magnitude (module docstring; the rule
    ``randattn.testing.assert_close_to_rounding`` shares with the GPU test); NaN where NaN; every other column
    exactly."""
    floats = [c for c in expected.columns if expected[c].dtype.kind == "f"]
    others = [c for c in expected.columns if c not in floats]
    pd.testing.assert_frame_equal(got[others], expected[others], check_exact=True, obj=name)
    for column in floats:
        column_close_to_rounding(got[column].to_numpy(dtype=float), expected[column].to_numpy(), rtol=1e-10,
                                 floor=ROUNDING.get(column), what=f"{name}: {column}")


def test_the_comparison_can_fail():
    """Negative control: one estimator's draws with another seed change the table beyond the tolerance."""
    table = pd.read_parquet(TABLE)
    moved = table.copy()
    moved.loc[moved["estimator"] == "rfa", "mse"] *= 1 + 1e-9
    assert_close_to_rounding(table, table, "the table against itself")
    try:
        assert_close_to_rounding(moved, table, "rfa's mse moved by 1e-9")
    except AssertionError:
        return
    raise AssertionError("a change of 1e-9 relative in the rfa rows went unnoticed")


if __name__ == "__main__" and sys.argv[1:] == ["--regenerate"]:
    DATA.mkdir(exist_ok=True)
    table, positions = _sweep()
    for made, path in ((table, TABLE), (positions, POSITIONS)):
        # the stored columns only: the file stands for a table written before the later columns
        # (tests/analysis/test_query_selection.py reads it so), which the comparison appends
        kept = list(pd.read_parquet(path).columns) if path.exists() else list(made.columns)
        made[kept].to_parquet(path, index=False)
    FINGERPRINT.write_text(json.dumps(_fingerprint(), indent=1) + "\n")
    print(f"wrote {TABLE}, {POSITIONS} ({len(table)} and {len(positions)} rows) and {FINGERPRINT}")
