r"""The conformance checks: what every estimator, built-in or plugin, must satisfy.

Each check is a function ``check(spec, params) -> None`` that raises :class:`CheckFailed` with a
message saying what was expected and what was found, or :class:`CheckSkipped` with the reason it
does not apply to this configuration. :func:`randattn.testing.check_estimator` runs them all.

Tolerances, and why:

- **same draws, float64**: batched and reference agree to ``1e-10`` absolute and relative
  (ARCHITECTURE sec. 3; summation order alone gives ~1e-14).
- **every mask**: the comparisons of batched with the reference (float64, float32, key norms 150-200) run
  under each mask the configuration declares (``masks``), with N <= M where the mask is causal.
- **float32**: :data:`~randattn.testing.TOLERANCES` ``(5e-5, 5e-5)``, a few hundred float32 ulps of
  outputs of order one. Estimators with signed weights are exempt (their sums cancel; the
  float64 check covers them).
- **discrete selection** (``selection="discrete"``: top-k, hashing): where two candidate keys nearly tie,
  float32 may select the other one, and its output row then differs from the reference by far more than
  rounding. Such a row is compared like with like: it passes only when the float64 reference row itself moves
  beyond the tolerance when q and k are perturbed by float32-sized amounts (relative ``16 eps32`` per entry,
  inputs and draws rounded to float32; 16 perturbations) -- a near tie -- and the float32 row matches one of
  those perturbed references. Every other row is held to the tolerance as usual.
- **key norms of 150-200**: float32 rounds a logit of size :math:`L` by about :math:`L
  \epsilon_{32}`, which moves an output by up to that times the spread of the values, so the
  float32 tolerance there is :math:`8 L_{\max} \epsilon_{32} \max|v|` with :math:`L_{\max}` the
  largest ``|scale q.k|``, ``|x|^2`` or ``|y|^2``.
- **unbiasedness**: every output element's mean over R replicates, in units of its own standard
  error (:math:`z`), within the two-sided normal quantile at :math:`\alpha = 10^{-6}` split over
  the elements (Bonferroni).
- **consistency**: the debiased squared bias at S = 64 at most 1/16 of that at S = 4 (bias falling
  at least like :math:`1/\sqrt{S}`; self-normalized IS has :math:`O(1/S)`), plus four jackknife
  standard errors of the difference; and the MSE falls. A constant bias fails.
- **exact limits**: the limit's declared ``rtol`` (1e-10 unless the spec says why not).
- **keys used**: where a spec declares ``keys_used``, its count for each query equals, exactly, the number of
  keys with a nonzero implied probability (``batched`` with ``v = I_M``, float64, inputs of norm ~ 1 so that no
  read key's weight underflows), under every declared mask, with N = M and N < M (the decode regime).
- **one key**: a normalized estimator returns that key's value to ``1e-12`` relative (a weight
  divided by itself: one rounding).

Every random input comes from a fixed seed, so a check's outcome is reproducible bit for bit.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Mapping

import numpy as np

from randattn.estimators.base import Draws, EstimatorSpec, validate_spec
from randattn.testing._assert import TOLERANCES, assert_close, plain_index, to_numpy

__all__ = ["CHECKS", "CheckFailed", "CheckSkipped"]

EPS32 = float(np.finfo(np.float32).eps)


class CheckFailed(AssertionError):
    """The estimator does not do what the check requires; the message says what and by how much."""


class CheckSkipped(Exception):
    """The check does not apply to this configuration; the message says why."""


#: (id, q shape, k shape, v shape): batch dims, N != M, Dv != D, D not a power of two, N = 1
ODD_SHAPES: tuple[tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...]], ...] = (
    ("batch 2x3, N=13, M=11, D=8, Dv=5", (2, 3, 13, 8), (2, 3, 11, 8), (2, 3, 11, 5)),
    ("no batch, N=1, M=7, D=3, Dv=2", (1, 3), (7, 3), (7, 2)),
    ("batch 4, N=M=29, D=6, Dv=6", (4, 29, 6), (4, 29, 6), (4, 29, 6)),
)
#: the shapes of :data:`ODD_SHAPES` for a causal mask, which needs N <= M (the queries are the last N of M tokens)
CAUSAL_ODD_SHAPES: tuple[tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...]], ...] = (
    ("batch 2x3, N=11, M=13, D=8, Dv=5", (2, 3, 11, 8), (2, 3, 13, 8), (2, 3, 13, 5)),
    *ODD_SHAPES[1:],
)
_SAMPLES = 8
_REPLICATES = 3
#: float32-sized perturbations of q and k that decide whether a discrete selection nearly ties (module docstring)
_TIE_PERTURBATIONS = 16
_TIE_SIZE = 16 * float(np.finfo(np.float32).eps)


# ---------------------------------------------------------------------------------------------------- calling a spec
def _draw(spec: EstimatorSpec, q_shape, k_shape, params, *, samples=_SAMPLES, replicates=_REPLICATES, seed=0,
          mask=None):
    kwargs = {"mask": mask} if mask is not None else {}
    return spec.draw(tuple(q_shape), tuple(k_shape), num_samples=samples if spec.needs_samples else None,
                     replicates=replicates, rng=np.random.default_rng(seed), **params, **kwargs)


def _reference(spec, q, k, v, draws, params, *, scale=None, mask=None) -> np.ndarray:
    kwargs = {"mask": mask} if mask is not None else {}
    return spec.reference(q, k, v, draws, scale=scale, **params, **kwargs)


def _batched(spec, q, k, v, draws, params, *, dtype, scale=None, mask=None):
    import torch

    kwargs = {"mask": mask} if mask is not None else {}
    t = lambda a: torch.as_tensor(np.asarray(a), dtype=dtype)  # noqa: E731
    return spec.batched(t(q), t(k), t(v), draws.to_torch(dtype=dtype), scale=scale, **params, **kwargs)


def _inputs(shapes, seed: int, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    q_shape, k_shape, v_shape = shapes
    return rng.standard_normal(q_shape) * scale, rng.standard_normal(k_shape) * scale, rng.standard_normal(v_shape)


def _softmax_attention(q, k, v, scale=None, visible=None) -> np.ndarray:
    """Exact attention written out here (float64, max-subtracted), independent of the package's estimators."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = scale * np.einsum("...nd,...md->...nm", q, k)
    if visible is not None:
        logits = np.where(visible, logits, -np.inf)
    logits = logits - logits.max(-1, keepdims=True)
    weights = np.exp(logits)
    return np.einsum("...nm,...md->...nd", weights / weights.sum(-1, keepdims=True), v)


def _quiet(func: Callable[[], Any]) -> Any:
    """Run ``func`` with warnings silenced (e.g. a signed estimator's non-positive-denominator warning)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return func()


def _close(actual, expected, *, atol, rtol, what) -> None:
    try:
        assert_close(actual, expected, atol=atol, rtol=rtol, what=what)
    except AssertionError as exc:
        raise CheckFailed(str(exc)) from None


def _masks(spec: EstimatorSpec, params: Mapping[str, Any]) -> tuple[str | None, ...]:
    """The masks the configuration declares, bidirectional (None) first."""
    masks = spec.masks_of(params)
    return (None, *(m for m in masks if m is not None))


def _odd_shapes(mask: str | None):
    return ODD_SHAPES if mask is None else CAUSAL_ODD_SHAPES


def _mask_words(mask: str | None) -> str:
    return "" if mask is None else f", mask={mask!r}"


def _rows_close(actual: np.ndarray, expected: np.ndarray, atol, rtol) -> np.ndarray:
    """``(R, ..., N)``: whether every element of an output row is within ``atol + rtol |expected|`` (NaN == NaN)."""
    both_nan = np.isnan(actual) & np.isnan(expected)
    with np.errstate(invalid="ignore"):
        ok = np.abs(actual - expected) <= atol + rtol * np.abs(expected)
    return (ok | both_nan).all(-1)


def _close32(spec, params, q, k, v, draws, bat32, ref, *, atol, rtol, what, mask=None) -> None:
    """float32 batched against the float64 reference; rows of a discrete selection that nearly ties compared
    like with like (module docstring)."""
    if spec.selection_of(params) != "discrete":
        _close(bat32, ref, atol=atol, rtol=rtol, what=what)
        return
    bat = to_numpy(bat32)
    agree = _rows_close(bat, ref, atol, rtol)
    if agree.all():
        return
    rng = np.random.default_rng(150)
    as32 = lambda a: np.asarray(a, dtype=np.float32).astype(np.float64)  # noqa: E731
    draws32 = Draws({key: as32(a) for key, a in draws.arrays.items()}, draws.replicates)
    near_tie = np.zeros(agree.shape, dtype=bool)
    matched = np.zeros(agree.shape, dtype=bool)
    for _ in range(_TIE_PERTURBATIONS):
        qp, kp = (as32(a * (1 + _TIE_SIZE * rng.uniform(-1, 1, np.shape(a)))) for a in (q, k))
        alternative = _quiet(lambda: _reference(spec, qp, kp, as32(v), draws32, params, mask=mask))
        near_tie |= ~_rows_close(alternative, ref, atol, rtol)
        matched |= _rows_close(bat, alternative, atol, rtol)
    bad = ~agree & ~(near_tie & matched)
    if not bad.any():
        return
    row = plain_index(np.argwhere(bad)[0])
    worst = float(np.nanmax(np.abs(bat[row] - ref[row])))
    why = ("the float64 reference row does not move under float32-sized perturbations of q and k, so this is no "
           "near tie" if not near_tie[row] else
           f"it is a near tie, but the float32 row matches none of the {_TIE_PERTURBATIONS} perturbed references")
    raise CheckFailed(f"{what} not close (selection='discrete'): {int(bad.sum())} of {bad.size} output rows differ "
                      f"beyond atol={atol:g}, rtol={rtol:g}; first at row {row}, max |diff| {worst:.3e}: {why}")


# ---------------------------------------------------------------------------------------------------- the checks
def check_spec_is_valid(spec: EstimatorSpec, params: Mapping[str, Any]) -> None:
    """The spec satisfies the protocol (:func:`~randattn.estimators.base.validate_spec`) and the parameters resolve."""
    try:
        validate_spec(spec)
        spec.resolve_params(params)
    except (TypeError, ValueError) as exc:
        raise CheckFailed(str(exc)) from None


def check_reference_matches_batched(spec: EstimatorSpec, params: Mapping[str, Any]) -> None:
    """batched (float64) == reference with the same draws, to 1e-10, over odd shapes, under every declared mask."""
    import torch

    atol, rtol = TOLERANCES["float64"]
    for mask, label, _, ref, bat in _reference_and_batched(spec, params, torch.float64, seed=10):
        _close(bat, ref, atol=atol, rtol=rtol,
               what=f"batched (float64) against reference, same draws, {label}{_mask_words(mask)}:")


def _reference_and_batched(spec: EstimatorSpec, params: Mapping[str, Any], dtype: Any, *, seed: int):
    """For every declared mask and odd shape: ``(mask, label, (q, k, v, draws), reference, batched in dtype)``, the
    inputs seeded ``seed + i`` and the draws ``seed + 10 + i``."""
    for mask in _masks(spec, params):
        for i, (label, *shapes) in enumerate(_odd_shapes(mask)):
            q, k, v = _inputs(shapes, seed=seed + i)
            draws = _draw(spec, q.shape, k.shape, params, seed=seed + 10 + i, mask=mask)
            ref = _quiet(lambda: _reference(spec, q, k, v, draws, params, mask=mask))
            bat = _quiet(lambda: _batched(spec, q, k, v, draws, params, dtype=dtype, mask=mask))
            yield mask, label, (q, k, v, draws), ref, bat


def check_shapes_and_dtypes(spec: EstimatorSpec, params: Mapping[str, Any]) -> None:
    """Both forms return ``(R, ..., N, Dv)``: the reference numpy float64, batched a tensor in the input dtype."""
    import torch

    for i, (label, *shapes) in enumerate(ODD_SHAPES):
        q, k, v = _inputs(shapes, seed=30 + i)
        expected = (_REPLICATES, *q.shape[:-1], v.shape[-1])
        draws = _draw(spec, q.shape, k.shape, params, seed=40 + i)
        ref = _quiet(lambda: _reference(spec, q, k, v, draws, params))
        if not isinstance(ref, np.ndarray) or ref.dtype != np.float64 or ref.shape != expected:
            raise CheckFailed(f"reference on {label} returned {type(ref).__name__} "
                              f"{getattr(ref, 'dtype', '?')} {getattr(ref, 'shape', '?')}; expected a numpy float64 "
                              f"array of shape (R, ..., N, Dv) = {expected}")
        for dtype in (torch.float32, torch.float64):
            out = _quiet(lambda: _batched(spec, q, k, v, draws, params, dtype=dtype))
            if not isinstance(out, torch.Tensor) or out.dtype != dtype or tuple(out.shape) != expected:
                raise CheckFailed(f"batched on {label} with {dtype} inputs returned {type(out).__name__} "
                                  f"{getattr(out, 'dtype', '?')} {tuple(getattr(out, 'shape', ()))}; expected a "
                                  f"{dtype} tensor of shape {expected}")


def check_seeded_reproducibility(spec: EstimatorSpec, params: Mapping[str, Any]) -> None:
    """The same seed gives the same draws and the same outputs, bit for bit; another seed other draws."""
    import torch

    _, *shapes = ODD_SHAPES[0]
    q, k, v = _inputs(shapes, seed=50)
    first, again = (_draw(spec, q.shape, k.shape, params, seed=7) for _ in range(2))
    for key in first.arrays:
        if not np.array_equal(np.asarray(first[key]), np.asarray(again[key]), equal_nan=True):
            raise CheckFailed(f"draw() with the same seed gave different {key!r}")
    if spec.is_random(params) and first.arrays:
        other = _draw(spec, q.shape, k.shape, params, seed=8)
        if all(np.array_equal(np.asarray(first[key]), np.asarray(other[key])) for key in first.arrays):
            raise CheckFailed("draw() with seeds 7 and 8 gave identical draws, but the estimator declares itself random")
    ref1, ref2 = (_quiet(lambda: _reference(spec, q, k, v, first, params)) for _ in range(2))
    if not np.array_equal(ref1, ref2, equal_nan=True):
        raise CheckFailed("reference is not a pure function of its draws: two calls differ")
    bat1, bat2 = (_quiet(lambda: _batched(spec, q, k, v, first, params, dtype=torch.float32)) for _ in range(2))
    if not torch.equal(torch.nan_to_num(bat1), torch.nan_to_num(bat2)):
        raise CheckFailed("batched (float32) is not a pure function of its draws: two calls differ")


def check_float32_matches_reference(spec: EstimatorSpec, params: Mapping[str, Any]) -> None:
    """batched in float32 is within a few hundred float32 ulps of the float64 reference (same draws), under every
    declared mask; a discrete selection's near ties compared like with like."""
    import torch

    if spec.has_signed_weights(params):
        raise CheckSkipped("signed weights cancel in float32; the float64 check covers this configuration")
    atol, rtol = TOLERANCES["float32"]
    for mask, label, (q, k, v, draws), ref, bat in _reference_and_batched(spec, params, torch.float32, seed=60):
        _close32(spec, params, q, k, v, draws, bat, ref, atol=atol, rtol=rtol, mask=mask,
                 what=f"batched (float32) against reference (float64), {label}{_mask_words(mask)}:")


def _large_norm_inputs(seed: int):
    """N = M = 9, D = 16, Dv = 4; every query and key row rescaled to a norm in [150, 200] (real ViT keys)."""
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((2, 2, 9, 16))
    q = q / np.linalg.norm(q, axis=-1, keepdims=True) * rng.uniform(150, 200, (2, 9, 1))
    k = k / np.linalg.norm(k, axis=-1, keepdims=True) * rng.uniform(150, 200, (2, 9, 1))
    return q, k, rng.standard_normal((2, 9, 4))


def check_finite_at_large_norms(spec: EstimatorSpec, params: Mapping[str, Any]) -> None:
    """Key and query norms of 150-200, under every declared mask: finite outputs (or a warning where a signed
    denominator is not positive), float64 batched == reference, float32 within the rounding of the logits."""
    import torch

    q, k, v = _large_norm_inputs(80)
    skipped = []
    for mask in _masks(spec, params):
        words = _mask_words(mask)
        draws = _draw(spec, q.shape, k.shape, params, seed=81, mask=mask)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ref = _reference(spec, q, k, v, draws, params, mask=mask)
        if not np.isfinite(ref).all():
            if not (spec.has_signed_weights(params) and caught):
                raise CheckFailed(f"reference is not finite at key norms 150-200{words} ({np.isnan(ref).sum()} NaN, "
                                  f"{np.isinf(ref).sum()} inf of {ref.size}) and no warning said why")
            skipped.append(mask)
            continue
        bat64 = _quiet(lambda: _batched(spec, q, k, v, draws, params, dtype=torch.float64, mask=mask))
        atol, rtol = TOLERANCES["float64"]
        _close(bat64, ref, atol=atol * np.abs(v).max(), rtol=rtol,
               what=f"batched (float64) at key norms 150-200{words}:")
        if spec.has_signed_weights(params):
            continue
        bat32 = _quiet(lambda: _batched(spec, q, k, v, draws, params, dtype=torch.float32, mask=mask))
        if not torch.isfinite(bat32).all():
            raise CheckFailed(f"batched (float32) is not finite at key norms 150-200{words} although the reference is")
        scale = q.shape[-1] ** -0.5
        largest_logit = max(np.abs(scale * q @ np.swapaxes(k, -1, -2)).max(), scale * (q**2).sum(-1).max(),
                            scale * (k**2).sum(-1).max())
        tol = 8 * largest_logit * EPS32 * np.abs(v).max()
        _close32(spec, params, q, k, v, draws, bat32, ref, atol=tol, rtol=0.0, mask=mask,
                 what=f"batched (float32) at key norms 150-200{words} (tolerance 8 L eps32 max|v|, "
                      f"L = {largest_logit:.0f}):")
    if skipped:
        masks = ", ".join("none" if m is None else repr(m) for m in skipped)
        raise CheckSkipped(f"a signed denominator is not positive at these norms (reported by a warning; mask {masks})")


def _replicate_outputs(spec, params, q, k, v, *, samples, replicates, seed) -> np.ndarray:
    """``(R, ..., N, Dv)`` float64 outputs of ``replicates`` independent replicates (batched form, float64)."""
    import torch

    draws = _draw(spec, q.shape, k.shape, params, samples=samples, replicates=replicates, seed=seed)
    return to_numpy(_quiet(lambda: _batched(spec, q, k, v, draws, params, dtype=torch.float64)))


def _moderate_inputs(n: int, m: int, seed: int):
    """D = 4 queries and keys with entries N(0, 0.4^2): |x + y|^2 stays near 1, where every built-in
    estimator's variance is finite and moderate (ARCHITECTURE sec. 9)."""
    rng = np.random.default_rng(seed)
    return rng.normal(0, 0.4, (n, 4)), rng.normal(0, 0.4, (m, 4)), rng.standard_normal((m, 3))


def check_convergence(spec: EstimatorSpec, params: Mapping[str, Any]) -> None:
    """The declared convergence holds: exact, unbiased (z-test per element) or consistent (S MSE(S) not growing)."""
    from scipy.stats import norm

    claim = spec.convergence_of(params)
    if claim == "none":
        raise CheckSkipped("the estimator declares no convergence (convergence='none')")
    if claim == "exact":
        _, *shapes = ODD_SHAPES[0]
        q, k, v = _inputs(shapes, seed=90)
        draws = _draw(spec, q.shape, k.shape, params, seed=91)
        ref = _quiet(lambda: _reference(spec, q, k, v, draws, params))
        exact = np.broadcast_to(_softmax_attention(q, k, v), ref.shape)
        _close(ref, exact, atol=1e-10, rtol=1e-10, what="declared exact, but the reference differs from softmax:")
        return
    if claim == "unbiased":
        q, k, v = _moderate_inputs(5, 7, seed=92)
        replicates = 4000
        out = _replicate_outputs(spec, params, q, k, v, samples=4, replicates=replicates, seed=93)
        exact = _softmax_attention(q, k, v)
        se = out.std(0, ddof=1) / math.sqrt(replicates)
        z = (out.mean(0) - exact) / np.where(se > 0, se, np.inf)
        limit = norm.isf(1e-6 / (2 * z.size))
        worst = plain_index(np.unravel_index(np.argmax(np.abs(z)), z.shape))
        if abs(z[worst]) > limit:
            mean, truth = float(out.mean(0)[worst]), float(exact[worst])
            raise CheckFailed(
                f"declared unbiased, but the mean of {replicates} replicates at S = 4 is {abs(z[worst]):.1f} standard "
                f"errors from exact softmax at element {worst} (mean {mean:.6g}, exact {truth:.6g}, difference "
                f"{mean - truth:.3g}, standard error {float(se[worst]):.3g}; allowed {limit:.1f}: alpha = 1e-6 over "
                f"{z.size} elements)")
        return
    # consistent: the mean over replicates moves toward exact as S grows. Self-normalized importance sampling
    # has bias O(1/S), so its squared bias falls like 1/S^2; the check asks only for 1/S (a constant bias fails),
    # and for the MSE to fall
    from randattn.analysis.metrics import replicate_metrics

    q, k, v = _moderate_inputs(64, 64, seed=94)
    exact = _softmax_attention(q, k, v)
    replicates, small, large = 400, 4, 64
    metrics = {}
    for s, seed in ((small, 95), (large, 96)):
        out = _replicate_outputs(spec, params, q, k, v, samples=s, replicates=replicates, seed=seed)
        metrics[s] = _quiet(lambda: replicate_metrics(out, exact))
    lo, hi = metrics[small], metrics[large]
    if not all(np.isfinite([lo.mse, hi.mse, lo.bias_sq, hi.bias_sq])):
        raise CheckFailed(f"declared consistent, but the MSE or squared bias is not finite at S = {small} or {large}")
    shrink = small / large
    allowed = 4.0 * math.hypot(float(hi.bias_sq_se), shrink * float(lo.bias_sq_se))
    excess = float(hi.bias_sq) - shrink * float(lo.bias_sq)
    if excess > allowed:
        raise CheckFailed(
            f"declared consistent, but the debiased squared bias does not fall like 1/S: {float(lo.bias_sq):.3g} at "
            f"S = {small}, {float(hi.bias_sq):.3g} at S = {large} (at most {shrink * float(lo.bias_sq):.3g} + "
            f"{allowed:.3g} allowed, 4 jackknife standard errors): the mean of {replicates} replicates does not "
            "approach exact softmax")
    if not float(hi.mse) < float(lo.mse):
        raise CheckFailed(f"declared consistent, but the MSE did not fall from S = {small} ({float(lo.mse):.3g}) "
                          f"to S = {large} ({float(hi.mse):.3g})")


def check_exact_limits(spec: EstimatorSpec, params: Mapping[str, Any]) -> None:
    """Each declared exact limit equals softmax attention, in both forms."""
    import torch

    if not spec.exact_limits:
        raise CheckSkipped("the spec declares no exact limits")
    for n, m in ((12, 12), (7, 12)):
        q, k, v = _inputs(((2, n, 6), (2, m, 6), (2, m, 3)), seed=100 + n)
        exact = _softmax_attention(q, k, v)
        for limit in spec.exact_limits:
            limit_params, samples = limit.resolve(n, m)
            limit_params = spec.resolve_params({**params, **limit_params})
            draws = _draw(spec, q.shape, k.shape, limit_params, samples=samples or 3, seed=101)
            tol = limit.rtol * np.abs(v).max()
            ref = _quiet(lambda: _reference(spec, q, k, v, draws, limit_params))
            _close(ref, np.broadcast_to(exact, ref.shape), atol=tol, rtol=limit.rtol,
                   what=f"exact limit '{limit.description}' (N={n}, M={m}), reference:")
            bat = _quiet(lambda: _batched(spec, q, k, v, draws, limit_params, dtype=torch.float64))
            _close(bat, np.broadcast_to(exact, ref.shape), atol=tol, rtol=limit.rtol,
                   what=f"exact limit '{limit.description}' (N={n}, M={m}), batched:")


def check_keys_used(spec: EstimatorSpec, params: Mapping[str, Any]) -> None:
    """``keys_used`` counts, per query and replicate, exactly the keys its estimate reads: those with a nonzero
    implied probability (``batched`` with ``v = I_M``), never more than the query sees."""
    import torch

    from randattn.estimators.masks import causal_visible

    if spec.keys_used is None:
        raise CheckSkipped("the spec declares no keys_used")
    for mask in _masks(spec, params):
        for n, m in ((9, 9), (3, 20)):
            q, k, _ = _inputs(((2, n, 5), (2, m, 5), (2, m, 1)), seed=150 + m)
            draws = _draw(spec, q.shape, k.shape, params, seed=151, mask=mask)
            eye = np.broadcast_to(np.eye(m), (2, m, m))
            kwargs = {"mask": mask} if mask is not None else {}
            t = lambda a: torch.as_tensor(np.asarray(a), dtype=torch.float64)  # noqa: E731
            used = to_numpy(_quiet(lambda: spec.keys_used(t(q), t(k), draws.to_torch(dtype=torch.float64), scale=None,
                                                         **params, **kwargs)))
            probabilities = to_numpy(_quiet(lambda: _batched(spec, q, k, eye, draws, params, dtype=torch.float64,
                                                             mask=mask)))
            where = f"keys_used (N={n}, M={m}{_mask_words(mask)})"
            if used.shape != (_REPLICATES, 2, n):
                raise CheckFailed(f"{where}: shape {used.shape}, expected (R, 2, N) = {(_REPLICATES, 2, n)}")
            read = (probabilities != 0).sum(axis=-1)
            if not np.array_equal(used, read):
                at = plain_index(np.argwhere(used != read)[0])
                raise CheckFailed(f"{where}: says {used[at]:g} keys at (replicate, batch, query) {at}, but the "
                                  f"estimate gives {int(read[at])} keys a nonzero probability")
            visible = causal_visible(n, m).sum(-1) if mask == "causal" else np.full(n, m)
            if (used > visible).any():
                raise CheckFailed(f"{where}: counts more keys than a query sees")


def check_single_key(spec: EstimatorSpec, params: Mapping[str, Any]) -> None:
    """A normalized estimator given one key returns that key's value for every query, exactly."""
    import torch

    if not spec.normalized:
        raise CheckSkipped("the spec does not declare normalized weights")
    q, k, v = _inputs(((3, 5, 4), (3, 1, 4), (3, 1, 2)), seed=110)
    draws = _draw(spec, q.shape, k.shape, params, seed=111)
    expected = np.broadcast_to(v, (_REPLICATES, 3, 5, 2))
    ref = _quiet(lambda: _reference(spec, q, k, v, draws, params))
    _close(ref, expected, atol=0.0, rtol=1e-12, what="one key (M = 1), reference:")
    bat = _quiet(lambda: _batched(spec, q, k, v, draws, params, dtype=torch.float64))
    _close(bat, expected, atol=0.0, rtol=1e-12, what="one key (M = 1), batched:")


def check_causal_prefix_invariance(spec: EstimatorSpec, params: Mapping[str, Any]) -> None:
    """Under ``mask="causal"``, output n is unchanged when the keys and values it may not see are junk
    (bit-identical in the reference, to 1e-12 in batched float64); query 0 of self-attention sees one key;
    with N = M the last query sees every key, so it equals the bidirectional output (same draws)."""
    import torch

    from randattn.estimators.masks import last_visible_key

    if not spec.supports_mask("causal", params):
        raise CheckSkipped("the spec does not declare causal support for this configuration")
    for n, m in ((10, 10), (6, 10)):
        q, k, v = _inputs(((2, n, 5), (2, m, 5), (2, m, 3)), seed=120 + m - n)
        draws = _draw(spec, q.shape, k.shape, params, seed=121, mask="causal")
        ref = _quiet(lambda: _reference(spec, q, k, v, draws, params, mask="causal"))
        bat = _quiet(lambda: _batched(spec, q, k, v, draws, params, dtype=torch.float64, mask="causal"))
        last = last_visible_key(n, m)
        junk_rng = np.random.default_rng(122)
        for cut in sorted({0, n // 2, n - 2}):
            hidden = slice(int(last[cut]) + 1, None)  # keys query `cut` (and every earlier one) may not see
            k2, v2 = k.copy(), v.copy()
            k2[..., hidden, :] = junk_rng.standard_normal(k2[..., hidden, :].shape) * 50
            v2[..., hidden, :] = junk_rng.standard_normal(v2[..., hidden, :].shape) * 1e3
            ref2 = _quiet(lambda: _reference(spec, q, k2, v2, draws, params, mask="causal"))
            if not np.array_equal(ref[..., : cut + 1, :], ref2[..., : cut + 1, :], equal_nan=True):
                diff = np.nanmax(np.abs(ref[..., : cut + 1, :] - ref2[..., : cut + 1, :]))
                raise CheckFailed(f"causal (N={n}, M={m}): replacing keys/values after position {int(last[cut])} "
                                  f"changed the reference outputs of queries 0..{cut} (max change {diff:.3g}): it uses "
                                  "keys its mask hides")
            bat2 = _quiet(lambda: _batched(spec, q, k2, v2, draws, params, dtype=torch.float64, mask="causal"))
            _close(bat2[..., : cut + 1, :], bat[..., : cut + 1, :], atol=1e-12, rtol=1e-12,
                   what=f"causal (N={n}, M={m}), batched, queries 0..{cut} after junk beyond key {int(last[cut])}:")
        if n == m and spec.normalized:
            _close(ref[..., 0, :], np.broadcast_to(v[..., 0, :], ref[..., 0, :].shape), atol=0.0, rtol=1e-12,
                   what=f"causal (N=M={n}): query 0 sees key 0 only and must return its value:")
        if n == m:  # with M > N a bidirectional estimator may place query n elsewhere than at token n + M - N
            bidirectional = _quiet(lambda: _reference(spec, q, k, v, draws, params))
            _close(ref[..., -1, :], bidirectional[..., -1, :], atol=1e-10, rtol=1e-10,
                   what=f"causal (N=M={n}): the last query sees every key, so it must equal the bidirectional output:")


def _batched_peak(spec: EstimatorSpec, params: Mapping[str, Any], n: int) -> int:
    """Peak working bytes of batched (float32, R = 1, S = 16, D = Dv = 16) at N = M = ``n``."""
    import torch

    from randattn.analysis.memory import measure_peak

    rng = np.random.default_rng(130)
    q, k, v = (torch.as_tensor(rng.standard_normal((n, 16)), dtype=torch.float32) for _ in range(3))
    draws = _draw(spec, q.shape, k.shape, params, samples=16, replicates=1, seed=131).to_torch(dtype=torch.float32)
    return measure_peak(lambda: _quiet(lambda: spec.batched(q, k, v, draws, scale=None, **params)), torch_tensors=True)


def check_no_quadratic_memory(spec: EstimatorSpec, params: Mapping[str, Any]) -> None:
    """A configuration declared linear never holds an N x M array: from N = M = 512 to 4096 its batched peak
    working memory grows at most sqrt(8 * 64) ~ 22.6 times (linear growth is 8 times, quadratic 64: the
    threshold is their geometric mean), and at 4096 it stays below one float32 N x M matrix."""
    if spec.cost_of(params) != "linear":
        raise CheckSkipped(f"declared cost is {spec.cost_of(params)!r}, not linear")
    small, large = 512, 4096
    peaks = {n: _batched_peak(spec, params, n) for n in (small, large)}
    matrix = large * large * 4
    growth = peaks[large] / max(peaks[small], 1)
    limit = math.sqrt((large / small) * (large / small) ** 2)
    if growth > limit or peaks[large] >= matrix:
        raise CheckFailed(
            f"declared linear, but batched's peak working memory grew {growth:.1f} times from N = M = {small} to "
            f"{large} ({peaks[small] / 2**20:.2f} -> {peaks[large] / 2**20:.1f} MiB; linear growth is "
            f"{large // small}, quadratic {(large // small) ** 2}, allowed {limit:.1f}; one float32 N x M matrix is "
            f"{matrix / 2**20:.0f} MiB): it allocates an N x M array")


def check_bad_inputs(spec: EstimatorSpec, params: Mapping[str, Any]) -> None:
    """Through ``randattn.estimate``, bad input raises an error that names it (shapes, NaN, empty, parameters)."""
    from randattn.api import estimate

    rng = np.random.default_rng(140)
    q, k, v = rng.standard_normal((5, 4)), rng.standard_normal((6, 4)), rng.standard_normal((6, 3))
    nan_q = q.copy()
    nan_q[0, 0] = np.nan
    cases = [
        ("k with another head dim", (q, rng.standard_normal((6, 5)), v), {}, ("D", "feature dim")),
        ("v with another token count", (q, k, rng.standard_normal((4, 3))), {}, ("M", "tokens")),
        ("NaN in q", (nan_q, k, v), {}, ("NaN",)),
        ("an empty sequence", (q[:0], k, v), {}, ("empty", "0 tokens")),
        ("an unknown parameter", (q, k, v), {"no_such_parameter": 1}, ("no_such_parameter",)),
        ("an unknown mask", (q, k, v), {"mask": "sideways"}, ("mask",)),
    ]
    for pname, param in spec.params.items():
        if param.choices:
            cases.append((f"a value of {pname!r} outside its choices", (q, k, v), {pname: "__not_a_choice__"}, (pname,)))
            break
    samples = {"num_samples": 4} if spec.needs_samples else {}
    for what, (qq, kk, vv), extra, words in cases:
        try:
            _quiet(lambda: estimate(spec, qq, kk, vv, seed=0, **samples, **{**params, **extra}))
        except (ValueError, TypeError) as exc:
            if not any(word in str(exc) for word in words):
                raise CheckFailed(f"{what}: the error does not name the problem ({', '.join(words)}): "
                                  f"{type(exc).__name__}: {exc}") from None
            continue
        except Exception as exc:
            raise CheckFailed(f"{what}: raised {type(exc).__name__} instead of ValueError/TypeError: {exc}") from None
        raise CheckFailed(f"{what}: no error was raised")


#: check name -> function, in the order they run
CHECKS: dict[str, Callable[[EstimatorSpec, Mapping[str, Any]], None]] = {
    "spec is valid": check_spec_is_valid,
    "reference == batched (float64)": check_reference_matches_batched,
    "shapes and dtypes": check_shapes_and_dtypes,
    "seeded reproducibility": check_seeded_reproducibility,
    "float32 batched": check_float32_matches_reference,
    "key norms 150-200": check_finite_at_large_norms,
    "declared convergence": check_convergence,
    "exact limits": check_exact_limits,
    "keys used": check_keys_used,
    "one key": check_single_key,
    "causal prefix invariance": check_causal_prefix_invariance,
    "no N x M memory": check_no_quadratic_memory,
    "bad inputs": check_bad_inputs,
}
