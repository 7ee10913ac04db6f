"""Comparison helpers shared by randattn's test-suite and by users checking their own estimators."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["ROUNDING_FLOOR", "assert_close", "assert_close_to_rounding", "to_numpy", "TOLERANCES", "all_variants",
           "variant_id"]

#: (atol, rtol) per dtype for batched-vs-reference comparisons. float64: the project's
#: 1e-10 (observed differences are ~1e-14, summation order only). float32: a few hundred
#: ulps of outputs of order 1 (eps32 = 1.2e-7), since logsumexp/softmax chains lose a few bits.
TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-10, 1e-10),
    "float32": (5e-5, 5e-5),
}


def to_numpy(array: Any) -> np.ndarray:
    """numpy float64 view of a numpy array or torch tensor (on any device)."""
    if hasattr(array, "detach"):
        array = array.detach().cpu()
    return np.asarray(array, dtype=np.float64)


def assert_close(actual: Any, expected: Any, *, atol: float, rtol: float = 0.0, what: str = "") -> None:
    """Assert ``|actual - expected| <= atol + rtol |expected|`` elementwise.

    On failure the message gives the worst element, its index, both values, the
    tolerances and the fraction of elements out of tolerance (xformers' habit).
    """
    a, e = to_numpy(actual), to_numpy(expected)
    if a.shape != e.shape:
        raise AssertionError(f"{what} shape mismatch: actual {a.shape}, expected {e.shape}")
    if a.size == 0:
        return
    nan_mismatch = np.isnan(a) != np.isnan(e)
    if nan_mismatch.any():
        idx = plain_index(np.unravel_index(np.argmax(nan_mismatch), a.shape))
        raise AssertionError(f"{what} NaN in one array only at {idx}: actual {float(a[idx])!r}, "
                             f"expected {float(e[idx])!r}")
    diff = np.abs(np.where(np.isnan(a), 0.0, a - e))
    allowed = atol + rtol * np.abs(np.where(np.isnan(e), 0.0, e))
    bad = diff > allowed
    if bad.any():
        idx = plain_index(np.unravel_index(np.argmax(diff - allowed), a.shape))
        # python floats: repr gives the shortest digits that tell the two apart, and no np.float64(...) wrapper
        raise AssertionError(
            f"{what} not close: worst at index {idx}: actual {float(a[idx])!r}, expected {float(e[idx])!r}, "
            f"|diff| {diff[idx]:.3e} > {allowed[idx]:.3e} (atol={atol:g}, rtol={rtol:g}); "
            f"{bad.mean():.2%} of {a.size} elements out of tolerance; max |diff| {diff.max():.3e}"
        )


def plain_index(index: Any) -> tuple[int, ...]:
    """A numpy index (e.g. from ``np.unravel_index``) as a tuple of python ints, which print as ``(0, 2)``
    rather than ``(np.int64(0), np.int64(2))``."""
    return tuple(int(i) for i in index)


#: the absolute floor of :func:`assert_close_to_rounding`, as a fraction of the column's largest magnitude: an exact
#: estimator's squared error is float64 rounding itself (softmax's MSE is ~1e-33 where random estimators' are ~1e-1),
#: which any change of summation order (another machine's kernels, a GPU) moves by 100 %
ROUNDING_FLOOR = 1e-14


def assert_close_to_rounding(actual: Any, expected: Any, *, rtol: float, floor: float | None = None,
                             what: str = "") -> None:
    """Assert one float column (of a table of metrics) equals another to ``rtol`` plus an absolute floor.

    The floor is ``floor`` if given, else :data:`ROUNDING_FLOOR` times the largest finite ``|expected|``: the
    column's rows that measure rounding (exact estimators) compare to rounding of the column's scale, the others
    to ``rtol``. Non-finite entries must sit at the same places with the same values (NaN where NaN).

    Parameters
    ----------
    actual, expected : (n,)
        The column, numpy or torch.
    rtol : float
        Relative tolerance of the finite entries.
    floor : float, optional
        Absolute tolerance instead of the column-relative one (a column that measures rounding itself).
    what : str
        Named in the failure message.
    """
    have, want = to_numpy(actual), to_numpy(expected)
    finite = np.isfinite(want)
    if floor is None:
        floor = ROUNDING_FLOOR * float(np.max(np.abs(want[finite]), initial=0.0))
    np.testing.assert_array_equal(np.isfinite(have), finite, err_msg=f"{what} (finite or not)")
    np.testing.assert_array_equal(have[~finite], want[~finite], err_msg=f"{what} (non-finite values)")
    np.testing.assert_allclose(have[finite], want[finite], rtol=rtol, atol=floor, err_msg=what)


def all_variants() -> list[tuple[str, str, dict]]:
    """(estimator, variant name, params) for every registered estimator variant."""
    from randattn.estimators.registry import get_spec, list_estimators

    cases = []
    for name in list_estimators():
        variants = get_spec(name).variants or {"default": {}}
        cases.extend((name, variant, dict(params)) for variant, params in variants.items())
    return cases


def variant_id(case: tuple[str, str, dict]) -> str:
    """pytest id ``estimator[variant]``."""
    return f"{case[0]}[{case[1]}]"
