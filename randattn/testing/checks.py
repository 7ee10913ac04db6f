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
- **consistency**: the debiased squared bias at S = 32 at most 1/8 of that at S = 4 (bias falling
  at least like :math:`1/\sqrt{S}`; self-normalized IS has :math:`O(1/S)`), plus four jackknife
  standard errors of the difference; and the MSE falls. On 64 queries and M = 128 keys, so that a budget of 32
  keys leaves keys out: a constant bias fails, also one that vanishes only once S covers every key.
- **unbiasedness's rounding floor**: each element's standard error is floored at ``8 eps64 sqrt(M) max|v|`` (~1e-14):
  the estimate and the exact value each round a sum of M terms by about ``sqrt(M) eps64 max|v|``, and a deterministic
  part of an estimate (keys kept exact) rounds the same way in every replicate, so its mean sits that far from the
  exact value whatever R; a random estimate's standard error (~1e-3) is far above it, so a bias is still resolved.
- **inputs that grow**: causal prefix invariance, the sliding window, keys used, the exact limits, the query blocks
  and unbiasedness run on small inputs (10, 10, 9 and 20, 12, 12 and 7 keys), which a budget of sinks and a window
  keeps exact: where every output a check compares is exact (masked) softmax to 1e-12 (for the exact limits: the
  configuration without the limit's parameters), the check runs again on more keys, M doubled up to
  :data:`GROWTH_CAP` = 64 (N in proportion; the sliding window with W = M/2), at the first size where the estimate
  departs from softmax; where none does it is skipped, saying "exact on this check's inputs ... run with a smaller
  budget". Configurations declared exact do not grow. Consistency (M = 128) is skipped where every replicate is
  exact.
- **unbiasedness's resolution**: 4000 replicates at S = 4 see a bias of about 5.4 standard errors of the
  replicate mean (:math:`\approx 0.085` of an output element's standard deviation on these inputs) or more; a
  smaller bias passes (a ratio estimator's :math:`O(1/S)` bias may).
- **exact limits**: the limit's declared ``rtol`` (1e-10 unless the spec says why not).
- **keys used**: where a spec declares ``keys_used``, its count for each query equals, exactly, the number of
  keys with a nonzero implied probability (``batched`` with ``v = I_M``, float64, inputs of norm ~ 1 so that no
  read key's weight underflows), under every declared mask, with N = M and N < M (the decode regime).
- **log denominator**: where a spec declares ``log_denominator`` (the estimate of the softmax normaliser a
  denominator promise is about), a float64 ``(R, ..., N)`` tensor, finite at key norms 150-200 under every declared
  mask, and in every declared exact limit (bidirectional) the exact log-normaliser (written out here) to the
  limit's ``rtol`` absolute in log space (relative in the normaliser).
- **sliding window** (where ``"sliding"`` is declared; every check that runs under the declared masks runs it as
  ``"sliding:4"``): output n is unchanged, bit for bit in the reference and to ``1e-12`` in batched float64, when
  every key and value outside its window is junk; ``"sliding:M"`` equals ``"causal"`` to ``1e-12`` (where that is
  declared too); and a normalized estimator under ``"sliding:1"`` returns each query's own value to ``1e-12``.
- **one key**: a normalized estimator returns that key's value to ``1e-12`` relative (a weight
  divided by itself: one rounding).
- **draws layout**: ``draw`` with 2 replicates on the first odd shape (batch 2 x 3) gives ``Draws`` of
  ``replicates=2`` whose arrays are float64 numpy of shape ``(2, 2, 3, ...)``, under every declared mask.
- **stacked draw** (only where the spec declares ``stacked_draw``): one ``draw`` over a 2 x 3 grid of generators
  equals, bit for bit, each generator's one-cell, one-replicate draw (exact: the same numbers, stacked).
- **seeds and replicates** (through ``randattn.estimate``, N = M = 64 so that no default local window covers every
  key): the same seed gives the same bits on both backends, which agree to ``1e-10``; another seed gives other bits
  exactly when the estimate is random *here* -- declared random and not exact softmax to ``1e-12`` on these inputs
  (a deterministic part, e.g. sink and local keys, may cover every key of a short input), else the same bits;
  the reference keeps the replicate dim of draws of one replicate, ``replicates=None`` drops it, and random
  replicates differ.
- **ViT-like norms** (queries up to 30, keys up to 40 with a CLS-like key at 150, D = 64, scale 1/8): every form
  finite and float64 batched == reference to ``1e-10 max|v|``; with a shared direction (inputs and draws rounded to
  float32 first, so both forms see the same numbers), float32 within :math:`8 L \epsilon_{32} \max|v|`, :math:`L =`
  scale max|q| max|k|: each weight is exp of a logit of size at most :math:`L` that float32 rounds by a few
  :math:`\epsilon_{32} L` (product, shift, exp and sums: a relative error of at most :math:`4 \epsilon_{32} L`), and a
  normalized positive combination moves by at most twice that times max|v|. This holds for signed weights computed
  in float64 too (LARA's), so signed configurations are not exempt here.
- **the optional probability forms** of ``spec.forms`` (:class:`~randattn.estimators.base.BatchedForms`; each
  skipped where the spec does not declare it; the messages name them ``forms.<form>``), over the odd shapes and
  every declared mask (N < M where causal): ``probabilities`` equals the reference and ``batched`` with
  ``v = I_M`` to ``1e-10`` (float64; the same computation up to summation order);
  ``estimate_with_probabilities`` gives ``batched``'s output and ``probabilities``' probabilities **bit for
  bit**, with the same warnings, in float64 and float32 (the sweep takes either path, and a table must not depend on
  which); ``estimate_with_probabilities_and_keys_used`` gives ``batched``'s output, ``estimate_with_probabilities``'
  probabilities and ``keys_used``' counts bit for bit, warning nothing the three calls do not (float64 and float32);
  ``estimate_with_float32_probabilities`` gives ``batched``'s output bit for bit and float32 probabilities
  within the returned bound of the float64 ones in each row's 2-norm, plus ``1e-12`` of the row's norm (the float64
  probabilities' own rounding against the exact quotient the bound is stated for, 1e-16 per entry, is far below
  float32's 1e-7); ``estimate_with_probability_factors`` gives ``batched``'s output bit for bit and ``left @ right``
  equal to the probabilities to the dtype's tolerance, with ``right`` in [0, 1] (the sweep's rounding bound for the
  factored error needs it; ``left`` takes any sign, e.g. signed weights), or None where a configuration has no
  factors (skipped when every call gives None).
- **bad inputs** (through ``randattn.estimate``): the error class that fits and the words of the API's message.

Every random input comes from a fixed seed, so a check's outcome is reproducible bit for bit.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Mapping

import numpy as np

from randattn.estimators.base import Draws, EstimatorSpec, validate_spec
from randattn.testing._assert import TOLERANCES, assert_close, plain_index, to_numpy

__all__ = ["CHECKS", "CheckFailed", "CheckSkipped", "configuration_refusal", "exact_on_check_inputs"]

EPS32 = float(np.finfo(np.float32).eps)
EPS64 = float(np.finfo(np.float64).eps)
#: the unbiasedness test's floor on a standard error, in units of eps64 sqrt(M) max|v| (:func:`check_convergence`)
_ROUNDING_SE_ULPS = 8


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
#: S of every check but the convergence test: a multiple of the page sizes of page-based selections (a page of 16
#: keys kept whole), and enough samples that a signed normalizer is rarely near zero on the odd shapes
_SAMPLES = 16
_REPLICATES = 3
#: float32-sized perturbations of q and k that decide whether a discrete selection nearly ties (module docstring)
_TIE_PERTURBATIONS = 16
_TIE_SIZE = 16 * float(np.finfo(np.float32).eps)


# ---------------------------------------------------------------------------------------------------- calling a spec
def _draw(spec: EstimatorSpec, q_shape, k_shape, params, *, samples=_SAMPLES, replicates=_REPLICATES, seed=0,
          mask=None):
    kwargs = {"mask": mask} if mask is not None else {}
    samples = samples if spec.needs_samples_of(params) else None
    return spec.draw(tuple(q_shape), tuple(k_shape), num_samples=samples, replicates=replicates,
                     rng=np.random.default_rng(seed), **params, **kwargs)


def configuration_refusal(spec: EstimatorSpec, params: Mapping[str, Any]) -> str | None:
    """Why ``spec``'s ``draw`` refuses the configuration ``params`` on the checks' inputs where it takes the
    defaults, or None.

    A value that the estimator's own rules refuse (``sinks=-1``, a rule between parameters) is the user's input,
    not a failed check: ``randattn check`` says so and exits 2, as ``randattn mse -e`` does, where every check
    would fail on it. Where the defaults are refused too the estimator is at fault, and the checks say how.
    """
    shape = (2, 10, 5)
    try:
        _draw(spec, shape, shape, spec.resolve_params({}))
    except (TypeError, ValueError):
        return None
    try:
        _draw(spec, shape, shape, spec.resolve_params(params))
    except (TypeError, ValueError) as exc:
        return str(exc)
    return None


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
    """Run ``func`` with warnings silenced (e.g. a signed estimator's non-positive-denominator warning), but for a
    plain ``RuntimeWarning`` (numpy's overflow, division by zero, invalid value), which is passed on: randattn's
    estimators raise none on the checks' inputs, so one is the estimator's own fault, and
    :func:`~randattn.testing.check_estimator` notes it."""
    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            return func()
    finally:
        for warning in caught:
            if warning.category is RuntimeWarning:  # randattn's own warnings are subclasses, and stay silent
                warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)


def _close(actual, expected, *, atol, rtol, what) -> None:
    try:
        assert_close(actual, expected, atol=atol, rtol=rtol, what=what)
    except AssertionError as exc:
        raise CheckFailed(str(exc)) from None


#: W of the sliding window the checks run a declared ``"sliding"`` under: below the key count of every odd shape but
#: the one-query one, so that the window cuts most rows
SLIDING_WINDOW = 4


def _masks(spec: EstimatorSpec, params: Mapping[str, Any]) -> tuple[str | None, ...]:
    """The masks the configuration declares, bidirectional (None) first; ``"sliding"`` as ``"sliding:4"``."""
    masks = spec.masks_of(params)
    return (None, *(f"sliding:{SLIDING_WINDOW}" if m == "sliding" else m for m in masks if m is not None))


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
    _check_seeds_through_estimate(spec, params)


def check_draws_layout(spec: EstimatorSpec, params: Mapping[str, Any]) -> None:
    """``draw`` gives :class:`Draws` of ``replicates`` R whose every array is a float64 numpy array of shape
    ``(R, *batch dims, ...)``, under every declared mask: the layout the sweep slices and stacks by cell."""
    for mask in _masks(spec, params):
        label, q_shape, k_shape, _ = _odd_shapes(mask)[0]
        batch = q_shape[:-2]
        draws = _draw(spec, q_shape, k_shape, params, replicates=2, seed=90, mask=mask)
        where = f"draw() on {label}, replicates=2{_mask_words(mask)}"
        if not isinstance(draws, Draws) or draws.replicates != 2:
            raise CheckFailed(f"{where} returned {type(draws).__name__} with replicates="
                              f"{getattr(draws, 'replicates', '?')}; expected Draws with replicates=2")
        for key, array in draws.arrays.items():
            if not isinstance(array, np.ndarray) or array.dtype != np.float64 or array.shape[:3] != (2, *batch):
                raise CheckFailed(f"{where} gave {key!r} as {type(array).__name__} {getattr(array, 'dtype', '?')} "
                                  f"of shape {np.shape(array)}; expected a float64 numpy array whose shape starts "
                                  f"with (replicates, *batch dims) = {(2, *batch)}")


def check_stacked_draw(spec: EstimatorSpec, params: Mapping[str, Any]) -> None:
    """Where the spec declares ``stacked_draw``: one ``draw`` over a (replicates, cells) grid of generators
    (:class:`~randattn.analysis.plan.StackedGenerators`) gives, bit for bit, the one-cell, one-replicate draws of
    each generator stacked (written out here), under every declared mask."""
    if not spec.stacked_draw:
        raise CheckSkipped("the spec does not declare stacked_draw: the sweep draws one cell and replicate a call")
    from randattn.analysis.plan import StackedGenerators, replicate_rng

    seeds, reps = (3, 4, 5), (0, 1)
    for mask in _masks(spec, params):
        label, q_shape, k_shape, _ = CAUSAL_ODD_SHAPES[0]
        q_shape, k_shape = q_shape[-2:], k_shape[-2:]
        kwargs = {"num_samples": _SAMPLES if spec.needs_samples_of(params) else None, **params}
        kwargs.update({"mask": mask} if mask is not None else {})
        grid = StackedGenerators([[replicate_rng(seed, r) for seed in seeds] for r in reps])
        try:
            block = spec.draw((len(seeds), *q_shape), (len(seeds), *k_shape), replicates=len(reps), rng=grid,
                              **kwargs)
        except (AttributeError, TypeError, ValueError) as exc:
            raise CheckFailed(f"draw() over a grid of generators{_mask_words(mask)} raised {type(exc).__name__}: "
                              f"{exc}; a draw that needs more of numpy's Generator than standard_normal, random "
                              "and chisquare, or other sizes, must not declare stacked_draw") from None
        for c, seed in enumerate(seeds):
            for i, r in enumerate(reps):
                one = spec.draw(q_shape, k_shape, replicates=1, rng=replicate_rng(seed, r), **kwargs)
                for key, array in one.arrays.items():
                    if key not in block.arrays or not np.array_equal(block.arrays[key][i, c], array[0]):
                        raise CheckFailed(f"draw() over a grid of generators{_mask_words(mask)} gave another "
                                          f"{key!r} for cell {c}, replicate {r} than one call with that cell's "
                                          "generator; a draw that is not the stack of its one-cell draws must not "
                                          "declare stacked_draw")


def _estimate(spec: EstimatorSpec, params: Mapping[str, Any], q, k, v, **kwargs) -> np.ndarray:
    """``randattn.estimate`` of the spec (the user's one call: seed -> draws -> estimate), as float64 numpy."""
    from randattn.api import estimate

    samples = _SAMPLES if spec.needs_samples_of(params) else None
    return to_numpy(_quiet(lambda: estimate(spec, q, k, v, num_samples=samples, **kwargs, **params)))


def _seed_inputs() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """N = M = 64, D = 4, Dv = 3, no batch dims (the odd shapes cover those): longer than the default local windows
    of the built-ins (EVA's 49), which would otherwise make them exact."""
    return _inputs(((64, 4), (64, 4), (64, 3)), seed=55)


def exact_on_check_inputs(spec: EstimatorSpec, params: Mapping[str, Any]) -> bool:
    """Whether a configuration that is not softmax attention returns it (to 1e-12) on the checks' longest inputs,
    64 keys (:func:`_seed_inputs`): a budget (sinks, a window, top-k) that covers every key of them leaves the checks
    of its approximation -- the masks, the query blocks, the convergence -- nothing to hold, and the report says so.
    False where the configuration declares itself exact or its estimate raises (a check reports that)."""
    if spec.convergence_of(params) == "exact":
        return False
    q, k, v = _seed_inputs()
    try:
        once = _quiet(lambda: _reference(spec, q, k, v, _draw(spec, q.shape, k.shape, params, seed=7), params))
    except Exception:  # noqa: BLE001 - a check already reports what the estimate raised
        return False
    return _is_softmax(once, q, k, v)


def _is_softmax(out: np.ndarray, q, k, v) -> bool:
    """Whether ``out`` is exact softmax attention of ``q, k, v`` to 1e-12, the checks' test of an exact estimate."""
    return bool(np.allclose(out, _softmax_attention(q, k, v), rtol=1e-12, atol=1e-12))


# ------------------------------------------------------------------------------------ checks that grow their inputs
#: the most keys a check grows its inputs to while the configuration returns exact softmax on them: the checks'
#: longest inputs (:func:`_seed_inputs`), the size :func:`exact_on_check_inputs` speaks of
GROWTH_CAP = 64


def _grown_sizes(n: int, m: int, *, keep_n: bool = False) -> list[tuple[int, int]]:
    """``(n, m)``, then M doubled while below :data:`GROWTH_CAP`, the last one the cap itself, with N in proportion
    (rounded, at least 1; ``keep_n``: N unchanged). ``(10, 10)`` -> 10, 20, 40, 64 keys; ``(3, 20)`` -> ``(6, 40)``,
    ``(10, 64)``."""
    sizes, grown = [(n, m)], m
    while grown < GROWTH_CAP:
        grown = min(2 * grown, GROWTH_CAP)
        sizes.append((n if keep_n else max(1, round(n * grown / m)), grown))
    return sizes


def _visible(n: int, m: int, mask: str | None) -> np.ndarray | None:
    """``(N, M)``: the keys each query sees, written out here: query n is token ``n + M - N``; ``"causal"`` shows it
    keys ``m <= n + M - N``, ``"sliding:W"`` the last W of those; None (every key) without a mask."""
    if mask is None:
        return None
    token = np.arange(n)[:, None] + m - n
    keys = np.arange(m)[None, :]
    seen = keys <= token
    if mask.startswith("sliding:"):
        seen &= keys > token - int(mask.partition(":")[2])
    return seen


def _exact_rows(out: np.ndarray, q, k, v, mask: str | None = None) -> np.ndarray:
    """``(R, ..., N)``: whether each output row is exact softmax attention under ``mask`` (written out here) to
    1e-12, the test of :func:`_is_softmax`."""
    exact = _softmax_attention(q, k, v, visible=_visible(q.shape[-2], k.shape[-2], mask))
    return _rows_close(np.asarray(out), np.broadcast_to(exact, np.shape(out)), 1e-12, 1e-12)


def _grows(spec: EstimatorSpec, params: Mapping[str, Any]) -> bool:
    """Whether a check grows its inputs where the configuration is exact softmax on them: not for a configuration
    declared exact (softmax is what it is meant to return; the comparison with masked softmax has held it)."""
    return spec.convergence_of(params) != "exact"


def _budget_hint(spec: EstimatorSpec, params: Mapping[str, Any]) -> str:
    """``"e.g. -p window=2"``: the configuration's integer parameters of 16 or more at an eighth of their values (a
    budget of keys, as a window or a number of sinks, is one), or the integer parameters in words."""
    ints = {name: value for name, value in params.items()
            if isinstance(value, (int, np.integer)) and not isinstance(value, bool)}
    large = [f"-p {name}={value // 8}" for name, value in ints.items() if value >= 16]
    if large:
        return "e.g. " + " ".join(large)
    known = ", ".join(f"{name}={value}" for name, value in ints.items())
    return "e.g. -p NAME=VALUE lowering what sets the keys kept exact" + (f" ({known})" if known else "")


def _exact_skip(spec: EstimatorSpec, params: Mapping[str, Any], sizes: str, grown: str | None = "") -> CheckSkipped:
    """The skip of a check whose every compared output was exact softmax up to :data:`GROWTH_CAP` keys (``grown``
    None: on inputs that did not grow)."""
    grown = "" if grown is None else f"; grown up to M={GROWTH_CAP}{grown}"
    return CheckSkipped(f"exact on this check's inputs ({sizes}{grown}): every output it "
                        "compares is exact softmax attention (1e-12), so it tested none of the approximation; run with "
                        f"a smaller budget, {_budget_hint(spec, params)}")


def _first_tested(sizes, case: Callable[..., bool]) -> bool:
    """Run ``case(*size, probe=...)`` over ``sizes`` (:func:`_grown_sizes`) until one tests something (returns True):
    the first size in full, the grown ones as probes. A failure at a grown size says why the inputs grew."""
    for i, size in enumerate(sizes):
        try:
            if case(*size, probe=i > 0):
                return True
        except CheckFailed as exc:
            if i == 0:
                raise
            raise CheckFailed(f"{exc} [inputs grown from N={sizes[0][0]}, M={sizes[0][1]}, where every output the "
                              "check compares was exact softmax]") from None
    return False


def _random_here(spec: EstimatorSpec, params: Mapping[str, Any], q, k, v, once: np.ndarray) -> bool:
    """Whether the configuration is random *and* its estimate ``once`` (one replicate on these inputs) is not exact
    softmax attention (to 1e-12): a deterministic part may cover every key of a short input (a sparse estimator's sink
    and local keys), leaving no random variable that reaches the output, so that another seed rightly gives the same
    bits."""
    if not spec.is_random(params):
        return False
    return not _is_softmax(once, q, k, v)


def _check_seeds_through_estimate(spec: EstimatorSpec, params: Mapping[str, Any]) -> None:
    """Through ``randattn.estimate``: on the reference backend seed 7 twice gives the same bits; on both backends
    seed 8 gives other bits exactly when the estimate is random here (:func:`_random_here`), else the same bits; and
    the torch backend (float64) agrees with the reference to 1e-10 for the same seed (the same draws)."""
    import torch

    q, k, v = _seed_inputs()
    first, again = (_estimate(spec, params, q, k, v, seed=7, replicates=3) for _ in range(2))
    if not np.array_equal(first, again, equal_nan=True):
        raise CheckFailed("randattn.estimate (backend='reference') with seed 7 twice gave different outputs")
    random_here = _random_here(spec, params, q, k, v, first[0])
    torch_first = _estimate(spec, params, q, k, v, seed=7, replicates=3, backend="torch", dtype=torch.float64)
    atol, rtol = TOLERANCES["float64"]
    _close(torch_first, first, atol=atol, rtol=rtol,
           what="randattn.estimate, seed 7: backend='torch' (float64) against backend='reference':")
    for backend, seven, extra in (("reference", first, {}), ("torch", torch_first, {"dtype": torch.float64})):
        other = _estimate(spec, params, q, k, v, seed=8, replicates=3, backend=backend, **extra)
        if random_here and np.array_equal(seven, other, equal_nan=True):
            raise CheckFailed(f"randattn.estimate (backend={backend!r}) gave identical outputs for seeds 7 and 8, but "
                              "the configuration declares itself random and is not exact on these inputs")
        if not random_here and not np.array_equal(seven, other, equal_nan=True):
            why = "is deterministic" if not spec.is_random(params) else "is exact softmax on these inputs"
            raise CheckFailed(f"randattn.estimate (backend={backend!r}) depends on the seed, but the configuration "
                              f"{why}: no random variable should reach its output")


def check_replicates(spec: EstimatorSpec, params: Mapping[str, Any]) -> None:
    """The reference keeps the replicate dim of draws of one replicate, ``(1, ..., N, Dv)``; through
    ``randattn.estimate``, ``replicates=None`` gives ``(..., N, Dv)`` (no replicate dim), ``replicates=4`` gives
    ``(4, ..., N, Dv)``, and where the estimate is random (:func:`_random_here`) replicates 0 and 1 differ."""
    q, k, v = _seed_inputs()  # no batch dims: the squeezed output is (N, Dv)
    one = _quiet(lambda: _reference(spec, q, k, v, _draw(spec, q.shape, k.shape, params, replicates=1), params))
    if np.shape(one) != (1, q.shape[0], v.shape[-1]):
        raise CheckFailed(f"the reference with draws of one replicate returned shape {np.shape(one)}; expected (R, N, "
                          f"Dv) = {(1, q.shape[0], v.shape[-1])}: the replicate dim stays when R = 1 (randattn "
                          "removes it for replicates=None)")
    single = _estimate(spec, params, q, k, v, seed=0, replicates=None)
    if single.shape != (q.shape[0], v.shape[-1]):
        raise CheckFailed(f"randattn.estimate with replicates=None returned shape {single.shape}; expected (N, Dv) = "
                          f"{(q.shape[0], v.shape[-1])} (no replicate dim)")
    many = _estimate(spec, params, q, k, v, seed=0, replicates=4)
    if many.shape != (4, q.shape[0], v.shape[-1]):
        raise CheckFailed(f"randattn.estimate with replicates=4 returned shape {many.shape}; expected (R, N, Dv) = "
                          f"{(4, q.shape[0], v.shape[-1])}")
    if _random_here(spec, params, q, k, v, single) and np.allclose(many[0], many[1]):
        raise CheckFailed("replicates 0 and 1 are equal although the estimate is random here: replicates share "
                          "their draws")


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



def _vit_like(seed: int, *, n: int = 50, d: int = 64, q_max: float = 30.0, k_max: float = 150.0,
              shared: float = 0.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Queries with norms in [1, 30] and keys in [1, 40] with one CLS-like key at 150, D = 64, N = M = 50: the norms
    of a ViT's attention inputs. ``shared`` > 0 adds a common direction (one for the queries, one for the keys) of
    that weight to every unit vector before rescaling, as real queries and keys share large mean components (then
    landmarks and proposals overlap, and signed weights nearly cancel)."""
    rng = np.random.default_rng(seed)
    directions = rng.standard_normal((2, d))
    directions /= np.linalg.norm(directions, axis=-1, keepdims=True)

    def with_norms(norms, common):
        x = rng.standard_normal((len(norms), d))
        x = x / np.linalg.norm(x, axis=-1, keepdims=True) + shared * common
        return x / np.linalg.norm(x, axis=-1, keepdims=True) * norms[:, None]

    q = with_norms(rng.uniform(1.0, q_max, n), directions[0])
    k_norms = rng.uniform(1.0, 40.0, n)
    k_norms[0] = k_max
    return q, with_norms(k_norms, directions[1]), rng.standard_normal((n, d))


def check_vit_like_norms(spec: EstimatorSpec, params: Mapping[str, Any]) -> None:
    """At a ViT's norms (:func:`_vit_like`, scale 1/8), under every declared mask: every form finite, float64
    batched == reference (1e-10, scaled by max|v|); and on inputs with a shared direction, rounded to float32 with the
    draws, float32 batched within ``8 eps32 L max|v|`` of the reference, ``L = scale max|q| max|k|``."""
    import torch

    q, k, v = _vit_like(82)
    atol, rtol = TOLERANCES["float64"]
    for mask in _masks(spec, params):
        words = _mask_words(mask)
        draws = _draw(spec, q.shape, k.shape, params, replicates=2, seed=83, mask=mask)
        ref = _quiet(lambda: _reference(spec, q, k, v, draws, params, mask=mask))
        if not np.isfinite(ref).all():
            raise CheckFailed(f"reference is not finite at ViT-like norms{words}")
        bat = {dtype: _quiet(lambda: _batched(spec, q, k, v, draws, params, dtype=dtype, mask=mask))
               for dtype in (torch.float64, torch.float32)}
        for dtype, out in bat.items():
            if not torch.isfinite(out).all():
                raise CheckFailed(f"batched ({dtype}) is not finite at ViT-like norms{words}")
        _close(bat[torch.float64], ref, atol=atol * np.abs(v).max(), rtol=rtol,
               what=f"batched (float64) at ViT-like norms{words}:")
    # float32 rounding of the logits: every weight is exp of a sum of D products x_n . y_m with |x_n . y_m| <= L, and
    # float32 evaluates it with an absolute error of a few eps32 L, so each positive weight has a relative error
    # <= 4 eps32 L (the product, the shift, the exp and the sums each round); a normalized positive combination
    # then moves by at most 2 * 4 eps32 L max|v|
    as32 = lambda a: np.asarray(a, dtype=np.float32).astype(np.float64)  # noqa: E731
    q, k, v = (as32(a) for a in _vit_like(84, shared=3.0))
    replicates = 8 if spec.has_signed_weights(params) else 2  # 8: enough draws to meet a near-cancelling normalizer
    for mask in _masks(spec, params):
        words = _mask_words(mask)
        draws = _draw(spec, q.shape, k.shape, params, samples=16, replicates=replicates, seed=85, mask=mask)
        draws = Draws({key: as32(a) for key, a in draws.arrays.items()}, draws.replicates)
        ref = _quiet(lambda: _reference(spec, q, k, v, draws, params, mask=mask))
        bat32 = _quiet(lambda: _batched(spec, q, k, v, draws, params, dtype=torch.float32, mask=mask))
        scale = q.shape[-1] ** -0.5
        bound_l = scale * np.linalg.norm(q, axis=-1).max() * np.linalg.norm(k, axis=-1).max()
        tol = 8 * EPS32 * bound_l * np.abs(v).max()
        _close32(spec, params, q, k, v, draws, bat32, ref, atol=tol, rtol=0.0, mask=mask,
                 what=f"batched (float32) at ViT-like norms with a shared direction{words} (tolerance 8 L eps32 "
                      f"max|v|, L = {bound_l:.0f}):")


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
        # N = 5 queries on M = 7 keys; where 8 replicates are all exact softmax there (a budget that covers 7 keys),
        # on more keys (7, 14, 28, 56, 64: the first where some is not), else skipped: a mean of exact values says
        # nothing of a bias
        for i, (n, m) in enumerate(_grown_sizes(5, 7, keep_n=True)):
            q, k, v = _moderate_inputs(n, m, seed=92)
            probe = _replicate_outputs(spec, params, q, k, v, samples=4, replicates=8, seed=93)
            if not _exact_rows(probe, q, k, v).all():
                break
        else:
            raise _exact_skip(spec, params, "N=5, M=7, S=4")
        grown = "" if i == 0 else " (M grown from 7, where every replicate was exact softmax)"
        replicates = 4000
        out = _replicate_outputs(spec, params, q, k, v, samples=4, replicates=replicates, seed=93)
        exact = _softmax_attention(q, k, v)
        se = out.std(0, ddof=1) / math.sqrt(replicates)
        # the estimate and the exact value each round their sums of M terms by about sqrt(M) eps max|v| (a random
        # walk of roundings), and a deterministic part of the estimate rounds the same way in every replicate, so
        # that its mean sits that far from the exact value whatever R: the standard error is floored at 8 eps sqrt(M)
        # max|v| (the two sums, a factor 4 for the normaliser, the exponentials and the mean's own sum), ~1e-14 here,
        # far below a random estimate's standard error (~1e-3), which a bias is measured against
        floor = _ROUNDING_SE_ULPS * EPS64 * math.sqrt(m) * float(np.abs(v).max())
        se = np.hypot(se, floor)
        z = (out.mean(0) - exact) / se
        limit = norm.isf(1e-6 / (2 * z.size))
        worst = plain_index(np.unravel_index(np.argmax(np.abs(z)), z.shape))
        if abs(z[worst]) > limit:
            mean, truth = float(out.mean(0)[worst]), float(exact[worst])
            raise CheckFailed(
                f"declared unbiased, but the mean of {replicates} replicates at S = 4 on N = {n}, M = {m}{grown} is "
                f"{abs(z[worst]):.1f} standard errors from exact softmax at element {worst} (mean {mean:.6g}, exact "
                f"{truth:.6g}, difference {mean - truth:.3g}, standard error {float(se[worst]):.3g}, at least the "
                f"rounding floor {floor:.2g}; allowed {limit:.1f}: alpha = 1e-6 over {z.size} elements)")
        return
    # consistent: the mean over replicates moves toward exact as S grows. Self-normalized importance sampling
    # has bias O(1/S), so its squared bias falls like 1/S^2; the check asks only for 1/S (a constant bias fails),
    # and for the MSE to fall
    from randattn.analysis.metrics import replicate_metrics

    q, k, v = _moderate_inputs(64, 128, seed=94)  # M = 128 > 32 = S: a budget of keys leaves keys out
    exact = _softmax_attention(q, k, v)
    replicates, small, large = 400, 4, 32
    metrics, outputs = {}, {}
    for s, seed in ((small, 95), (large, 96)):
        out = outputs[s] = _replicate_outputs(spec, params, q, k, v, samples=s, replicates=replicates, seed=seed)
        metrics[s] = _quiet(lambda: replicate_metrics(out, exact))
        if s == large and all(_exact_rows(out, q, k, v).all() for out in outputs.values()):
            raise _exact_skip(spec, params, f"N=64, M=128, S={small} and {large}", None)
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
    """Each declared exact limit equals softmax attention, in both forms, on N = M = 12 and N = 7 < M = 12.

    Where the configuration itself (without the limit's parameters) is exact softmax on those inputs, a limit
    that does not make it exact elsewhere (parameters that cover 12 keys but not M) would pass: that case is run
    again on more keys (:func:`_grown_sizes`, up to :data:`GROWTH_CAP`; the limit's parameters resolved for them) at
    the first size where the configuration is not exact, and the check is skipped, saying so, where it is at
    every size."""
    if not spec.exact_limits:
        raise CheckSkipped("the spec declares no exact limits")
    vacuous = []
    for n0, m0 in ((12, 12), (7, 12)):
        sizes = _grown_sizes(n0, m0) if _grows(spec, params) else [(n0, m0)]
        if not _first_tested(sizes, lambda n, m, probe: _exact_limits_case(spec, params, n, m, probe=probe)) \
                and _grows(spec, params):
            vacuous.append(f"N={n0}, M={m0}")
    if len(vacuous) == 2:
        raise _exact_skip(spec, params, " and ".join(vacuous) + " without the limits' parameters")


def _exact_limits_case(spec: EstimatorSpec, params: Mapping[str, Any], n: int, m: int, *, probe: bool) -> bool:
    """One size of :func:`check_exact_limits` (inputs seeded ``100 + N``, draws 101); whether the configuration
    without the limits' parameters is not exact softmax there (True where its estimate raises: the limits are then
    what the size tests). ``probe``: return at once where it is."""
    import torch

    q, k, v = _inputs(((2, n, 6), (2, m, 6), (2, m, 3)), seed=100 + n)
    exact = _softmax_attention(q, k, v)
    try:
        plain = _quiet(lambda: _reference(spec, q, k, v, _draw(spec, q.shape, k.shape, params, seed=101), params))
        tested = not _exact_rows(plain, q, k, v).all()
    except Exception:  # noqa: BLE001 - a configuration that needs other inputs; the limits are still checked
        tested = True
    if probe and not tested:
        return False
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
    return tested


def _per_query_cases(spec: EstimatorSpec, params: Mapping[str, Any], *, seed: int):
    """For every declared mask, N = M = 9 and the decode regime N = 3 < M = 20 (batch 2, D = 5):
    ``(mask, n, m, q, k, draws)``, inputs seeded ``seed + m`` and draws ``seed + 1``."""
    for mask in _masks(spec, params):
        for n, m in ((9, 9), (3, 20)):
            q, k, _ = _inputs(((2, n, 5), (2, m, 5), (2, m, 1)), seed=seed + m)
            yield mask, n, m, q, k, _draw(spec, q.shape, k.shape, params, seed=seed + 1, mask=mask)


def check_keys_used(spec: EstimatorSpec, params: Mapping[str, Any]) -> None:
    """``keys_used`` counts, per query and replicate, exactly the keys its estimate reads: those with a nonzero
    implied probability (``batched`` with ``v = I_M``), never more than the query sees; under every declared mask,
    with N = M = 9 and the decode regime N = 3 < M = 20. Where every implied probability is exact softmax's (every
    visible key read, a budget that covers them), a count of the visible keys passes whatever the estimator counts
    when it samples: the case is run again on more keys (:func:`_grown_sizes`, up to :data:`GROWTH_CAP`) at the
    first size where some is not, and the check is skipped, saying so, where none is."""
    if spec.keys_used is None:
        raise CheckSkipped("the spec declares no keys_used")
    tested = False
    for mask in _masks(spec, params):
        for n0, m0 in ((9, 9), (3, 20)):
            sizes = _grown_sizes(n0, m0) if _grows(spec, params) else [(n0, m0)]
            tested |= _first_tested(sizes, lambda n, m, probe: _keys_used_case(spec, params, mask, n, m))
    if not tested and _grows(spec, params):
        raise _exact_skip(spec, params, "N=9, M=9 and N=3, M=20, under every declared mask")


def _keys_used_case(spec: EstimatorSpec, params: Mapping[str, Any], mask: str | None, n: int, m: int) -> bool:
    """One size and mask of :func:`check_keys_used` (inputs seeded ``150 + M``, draws 151); whether some implied
    probability row is not exact softmax's."""
    import torch

    from randattn.estimators.masks import Mask

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
    visible = Mask.parse(mask).visible_counts(n, m)
    if (used > visible).any():
        raise CheckFailed(f"{where}: counts more keys than a query sees")
    return not _exact_rows(probabilities, q, k, eye, mask).all()


def _log_normaliser(q, k) -> np.ndarray:
    """``log sum_m exp(s q_n . k_m)``, written out here (float64, max-subtracted)."""
    logits = q.shape[-1] ** -0.5 * np.einsum("...nd,...md->...nm", q, k)
    top = logits.max(-1, keepdims=True)
    return np.log(np.exp(logits - top).sum(-1)) + top[..., 0]


def _log_denominator(spec: EstimatorSpec, q, k, draws, params, mask) -> np.ndarray:
    import torch

    kwargs = {"mask": mask} if mask is not None else {}
    t = lambda a: torch.as_tensor(np.asarray(a), dtype=torch.float64)  # noqa: E731
    value = _quiet(lambda: spec.log_denominator(t(q), t(k), draws.to_torch(dtype=torch.float64), scale=None,
                                                **params, **kwargs))
    if not isinstance(value, torch.Tensor) or value.dtype != torch.float64:
        raise CheckFailed(f"log_denominator must return a float64 torch tensor, got "
                          f"{getattr(value, 'dtype', type(value).__name__)}")
    return to_numpy(value)


def check_log_denominator(spec: EstimatorSpec, params: Mapping[str, Any]) -> None:
    """``log_denominator``: float64 ``(R, ..., N)``, finite at key norms 150-200 (a log, never an overflowing
    exponential), under every declared mask; and in each declared exact limit (bidirectional) equal to the exact
    ``log sum_m exp(s q_n . k_m)`` (written out here) to the limit's ``rtol`` in log space, i.e. relative in the
    normaliser."""
    if spec.log_denominator is None:
        raise CheckSkipped("the spec declares no log_denominator")
    for mask, n, m, q, k, draws in _per_query_cases(spec, params, seed=160):
        value = _log_denominator(spec, q, k, draws, params, mask)
        where = f"log_denominator (N={n}, M={m}{_mask_words(mask)})"
        if value.shape != (_REPLICATES, 2, n):
            raise CheckFailed(f"{where}: shape {value.shape}, expected (R, 2, N) = {(_REPLICATES, 2, n)}")
        if not np.isfinite(value).all():
            raise CheckFailed(f"{where}: {int((~np.isfinite(value)).sum())} of {value.size} values not finite")
    q, k, _ = _large_norm_inputs(162)
    for mask in _masks(spec, params):
        value = _log_denominator(spec, q, k, _draw(spec, q.shape, k.shape, params, seed=163, mask=mask), params, mask)
        if not np.isfinite(value).all():
            raise CheckFailed(f"log_denominator at key norms 150-200{_mask_words(mask)}: "
                              f"{int((~np.isfinite(value)).sum())} of {value.size} values not finite")
    for limit in spec.exact_limits:  # bidirectional, as check_exact_limits
        for n, m in ((12, 12), (7, 12)):
            q, k, _ = _inputs(((2, n, 6), (2, m, 6), (2, m, 3)), seed=164 + n)
            limit_params, samples = limit.resolve(n, m)
            limit_params = spec.resolve_params({**params, **limit_params})
            draws = _draw(spec, q.shape, k.shape, limit_params, samples=samples or 3, seed=165)
            value = _log_denominator(spec, q, k, draws, limit_params, None)
            _close(value, np.broadcast_to(_log_normaliser(q, k), value.shape), atol=limit.rtol, rtol=0.0,
                   what=f"log_denominator in the exact limit '{limit.description}' (N={n}, M={m}):")


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
    """Under ``mask="causal"``, outputs 0..n are unchanged when the keys and values they may not see, and the queries
    after n, are junk (bit-identical in the reference, to 1e-12 in batched float64): a causal output is a function of
    the tokens up to its own; query 0 of self-attention sees one key; with N = M the last query sees every key, so it
    equals the bidirectional output (same draws).

    Run with N = M = 10 and N = 6 < M = 10; where every output compared is exact causal softmax (a budget of sinks
    and a window that covers the query's keys), the case is run again on more keys (:func:`_grown_sizes`, up to
    :data:`GROWTH_CAP`) at the first size where some is not, and the check is skipped, saying so, where none is."""
    if not spec.supports_mask("causal", params):
        raise CheckSkipped("the spec does not declare causal support for this configuration")
    vacuous = []
    for n0, m0 in ((10, 10), (6, 10)):
        sizes = _grown_sizes(n0, m0) if _grows(spec, params) else [(n0, m0)]
        tested = _first_tested(sizes, lambda n, m, probe: _causal_case(spec, params, n, m, probe=probe))
        if not tested and _grows(spec, params):
            vacuous.append(f"N={n0}, M={m0}")
    if len(vacuous) == 2:
        raise _exact_skip(spec, params, " and ".join(vacuous) + ", mask='causal'")


def _causal_case(spec: EstimatorSpec, params: Mapping[str, Any], n: int, m: int, *, probe: bool) -> bool:
    """One size of :func:`check_causal_prefix_invariance`; whether some output it compares (queries 0..N-2) is not
    exact causal softmax. ``probe``: return at once where every one is (the size tests nothing)."""
    import torch

    from randattn.estimators.masks import last_visible_key

    q, k, v = _inputs(((2, n, 5), (2, m, 5), (2, m, 3)), seed=120 + m - n)
    draws = _draw(spec, q.shape, k.shape, params, seed=121, mask="causal")
    ref = _quiet(lambda: _reference(spec, q, k, v, draws, params, mask="causal"))
    tested = not _exact_rows(ref, q, k, v, "causal")[..., : max(n - 1, 1)].all()
    if probe and not tested:
        return False
    bat = _quiet(lambda: _batched(spec, q, k, v, draws, params, dtype=torch.float64, mask="causal"))
    last = last_visible_key(n, m)
    junk_rng = np.random.default_rng(122)
    for cut in sorted({0, n // 2, n - 2}):
        hidden = slice(int(last[cut]) + 1, None)  # keys query `cut` (and every earlier one) may not see
        later = slice(cut + 1, None)  # queries after `cut`: tokens query `cut` may not see either
        q2, k2, v2 = q.copy(), k.copy(), v.copy()
        k2[..., hidden, :] = junk_rng.standard_normal(k2[..., hidden, :].shape) * 50
        v2[..., hidden, :] = junk_rng.standard_normal(v2[..., hidden, :].shape) * 1e3
        q2[..., later, :] = junk_rng.standard_normal(q2[..., later, :].shape) * 50
        ref2 = _quiet(lambda: _reference(spec, q2, k2, v2, draws, params, mask="causal"))
        if not np.array_equal(ref[..., : cut + 1, :], ref2[..., : cut + 1, :], equal_nan=True):
            diff = np.nanmax(np.abs(ref[..., : cut + 1, :] - ref2[..., : cut + 1, :]))
            # which of the two: the hidden keys alone, or else the later queries
            keys_only = _quiet(lambda: _reference(spec, q, k2, v2, draws, params, mask="causal"))
            if not np.array_equal(ref[..., : cut + 1, :], keys_only[..., : cut + 1, :], equal_nan=True):
                raise CheckFailed(f"causal (N={n}, M={m}): replacing keys/values after position {int(last[cut])} "
                                  f"changed the reference outputs of queries 0..{cut} (max change {diff:.3g}): it "
                                  "uses keys its mask hides")
            raise CheckFailed(f"causal (N={n}, M={m}): replacing the queries after {cut} changed the reference outputs "
                              f"of queries 0..{cut} (max change {diff:.3g}): a causal output depends on later tokens "
                              "(it pools the queries present; declare no causal mask, or pool only earlier queries)")
        bat2 = _quiet(lambda: _batched(spec, q2, k2, v2, draws, params, dtype=torch.float64, mask="causal"))
        _close(bat2[..., : cut + 1, :], bat[..., : cut + 1, :], atol=1e-12, rtol=1e-12,
               what=f"causal (N={n}, M={m}), batched, queries 0..{cut} after junk beyond key {int(last[cut])} and "
                    f"query {cut}:")
    if n == m and spec.normalized:
        _close(ref[..., 0, :], np.broadcast_to(v[..., 0, :], ref[..., 0, :].shape), atol=0.0, rtol=1e-12,
               what=f"causal (N=M={n}): query 0 sees key 0 only and must return its value:")
    if n == m:  # with M > N a bidirectional estimator may place query n elsewhere than at token n + M - N
        bidirectional = _quiet(lambda: _reference(spec, q, k, v, draws, params))
        _close(ref[..., -1, :], bidirectional[..., -1, :], atol=1e-10, rtol=1e-10,
               what=f"causal (N=M={n}): the last query sees every key, so it must equal the bidirectional output:")
    return tested


def check_sliding_window(spec: EstimatorSpec, params: Mapping[str, Any]) -> None:
    r"""Under ``mask="sliding:W"`` (where declared), output n is unchanged when every key and value outside its window
    :math:`n + M - N - W < m \le n + M - N` is junk (bit-identical in the reference, to 1e-12 in batched float64);
    a window over every key is the causal mask (1e-12); and for a normalized estimator a window of one key returns
    each query's own value.

    Run with W = 4 on N = M = 10 and N = 6 < M = 10; where every output compared is exact windowed softmax (a local
    window of the estimator's own that covers W keys), the case is run again on more keys with W = M / 2
    (:func:`_grown_sizes`, up to :data:`GROWTH_CAP`) at the first size where some is not, and the check is skipped,
    saying so, where none is."""
    if not spec.supports_mask("sliding:1", params):
        raise CheckSkipped("the spec does not declare sliding-window support for this configuration")
    vacuous = []
    for n0, m0 in ((10, 10), (6, 10)):
        sizes = _grown_sizes(n0, m0) if _grows(spec, params) else [(n0, m0)]
        if not _first_tested(sizes, lambda n, m, probe: _sliding_case(
                spec, params, n, m, m // 2 if probe else SLIDING_WINDOW, probe=probe)) and _grows(spec, params):
            vacuous.append(f"N={n0}, M={m0}")
    if len(vacuous) == 2:
        raise _exact_skip(spec, params, " and ".join(vacuous) + f", mask='sliding:{SLIDING_WINDOW}'", " with W=M/2")


def _sliding_case(spec: EstimatorSpec, params: Mapping[str, Any], n: int, m: int, window: int, *,
                  probe: bool) -> bool:
    """One size of :func:`check_sliding_window`; whether some output it compares (queries 0, N/2 and N-1) is not
    exact windowed softmax. ``probe``: return at once where every one is (the size tests nothing)."""
    import torch

    from randattn.estimators.masks import last_visible_key

    mask = f"sliding:{window}"
    q, k, v = _inputs(((2, n, 5), (2, m, 5), (2, m, 3)), seed=130 + m - n)
    draws = _draw(spec, q.shape, k.shape, params, seed=131, mask=mask)
    ref = _quiet(lambda: _reference(spec, q, k, v, draws, params, mask=mask))
    queries = sorted({0, n // 2, n - 1})
    tested = not _exact_rows(ref, q, k, v, mask)[..., queries].all()
    if probe and not tested:
        return False
    bat = _quiet(lambda: _batched(spec, q, k, v, draws, params, dtype=torch.float64, mask=mask))
    last = last_visible_key(n, m)
    junk_rng = np.random.default_rng(132)
    for query in queries:
        outside = np.ones(m, dtype=bool)
        outside[max(int(last[query]) - window + 1, 0): int(last[query]) + 1] = False
        k2, v2 = k.copy(), v.copy()
        k2[..., outside, :] = junk_rng.standard_normal(k2[..., outside, :].shape) * 50
        v2[..., outside, :] = junk_rng.standard_normal(v2[..., outside, :].shape) * 1e3
        ref2 = _quiet(lambda: _reference(spec, q, k2, v2, draws, params, mask=mask))
        if not np.array_equal(ref[..., query, :], ref2[..., query, :], equal_nan=True):
            diff = np.nanmax(np.abs(ref[..., query, :] - ref2[..., query, :]))
            raise CheckFailed(f"{mask} (N={n}, M={m}): replacing the keys/values outside query {query}'s window "
                              f"(keys {max(int(last[query]) - window + 1, 0)}..{int(last[query])}) changed its "
                              f"reference output (max change {diff:.3g}): it uses keys its mask hides")
        bat2 = _quiet(lambda: _batched(spec, q, k2, v2, draws, params, dtype=torch.float64, mask=mask))
        _close(bat2[..., query, :], bat[..., query, :], atol=1e-12, rtol=1e-12,
               what=f"{mask} (N={n}, M={m}), batched, query {query} after junk outside its window:")
    # each mask's draws are made under it, as a run makes them (a draw may depend on the mask: vAttention's
    # adaptive uniforms are as many as a window's keys); a window over every key is compared with the causal
    # mask on the causal draws, the same random variables for both
    with_causal = spec.supports_mask("causal", params)
    wide = _draw(spec, q.shape, k.shape, params, seed=131, mask="causal" if with_causal else f"sliding:{m}")
    whole = _quiet(lambda: _reference(spec, q, k, v, wide, params, mask=f"sliding:{m}"))
    if with_causal:
        causal = _quiet(lambda: _reference(spec, q, k, v, wide, params, mask="causal"))
        _close(whole, causal, atol=1e-12, rtol=1e-12,
               what=f"sliding:{m} (N={n}, M={m}): a window over every key is the causal mask:")
    if spec.normalized:
        single = _draw(spec, q.shape, k.shape, params, seed=131, mask="sliding:1")
        own = _quiet(lambda: _reference(spec, q, k, v, single, params, mask="sliding:1"))
        expected = np.broadcast_to(v[..., m - n:, :], own.shape)
        _close(own, expected, atol=0.0, rtol=1e-12,
               what=f"sliding:1 (N={n}, M={m}): each query sees its own key only and must return its value:")
    return tested


def _aligned_draws(full, block, rows: slice, keys: int, num_queries: int, num_keys: int):
    """``full``'s arrays cut to ``block``'s shapes: an axis of N queries where the block has its rows (``rows``), any
    other shorter axis to its first entries (M keys to the block's ``keys``; vAttention's per-query uniforms, read
    in order); None where an axis is longer in the block or an array is missing (the check then cannot give the
    block the rows' own random variables)."""
    from randattn.estimators.base import Draws

    arrays = {}
    for name, whole in full.arrays.items():
        want = np.shape(block.arrays.get(name))
        whole = np.asarray(whole)
        if name not in block.arrays or len(want) != whole.ndim:
            return None
        index = []
        for size, target in zip(whole.shape, want):
            if size == target:
                index.append(slice(None))
            elif size == num_queries and target == rows.stop - rows.start:
                index.append(rows)
            elif target < size:
                index.append(slice(0, target))
            else:
                return None
        arrays[name] = whole[tuple(index)]
    return None if set(arrays) != set(block.arrays) else Draws(arrays, full.replicates)


def check_query_blocks(spec: EstimatorSpec, params: Mapping[str, Any]) -> None:
    """A configuration that declares its queries estimated alone (``query_placement`` ``independent``, or
    ``last-n-of-m`` under a mask), whatever its cost: queries 4..8 of 12 estimated alone, with the keys they see
    (under a mask the first 9 + M - N, every key without), give those rows of one call over every query, given the
    same random variables (the full draws, cut to the block's shapes: the rows' own along the query axis, the first
    entries along any other, :func:`_aligned_draws`): to 1e-12 in both forms. ``randattn mse`` estimates a quadratic
    one a block of queries at a time (:mod:`randattn.analysis.query_blocks`), and ``mse --queries`` takes any one's
    subsets; an estimate that pools the queries present (landmarks from the queries, a temperature from their mean)
    fails: its placement is ``proportional``.

    Where those rows are exact softmax under the mask (a budget that covers 12 keys), a pooled estimate passes
    unseen: the mask's case is run again on more queries and keys (N = M doubled up to :data:`GROWTH_CAP`, rows
    N/3..3N/4) at the first size where some is not, and the check is skipped, saying so, where none is."""
    resolved = spec.resolve_params(params)
    placement = spec.query_placement_of(resolved)
    if placement == "proportional":
        raise CheckSkipped(f"not estimated in query blocks (query placement {placement!r})")
    masks = [mask for mask in _masks(spec, params) if mask is not None or placement == "independent"]
    if not masks:
        raise CheckSkipped("query placement 'last-n-of-m' and no mask declared: never estimated in query blocks")
    tested = False
    for mask in masks:
        sizes = _grown_sizes(12, 12) if _grows(spec, params) else [(12, 12)]
        tested |= _first_tested(sizes, lambda n, m, probe: _query_block_case(spec, params, placement, mask, n,
                                                                             probe=probe))
    if not tested and _grows(spec, params):
        raise _exact_skip(spec, params, "N=M=12, rows 4..8, under every declared mask")


def _query_block_case(spec: EstimatorSpec, params: Mapping[str, Any], placement: str, mask: str | None, n: int, *,
                      probe: bool) -> bool:
    """One size (N = M = ``n``, rows N/3..3N/4: 4..8 of 12) and mask of :func:`check_query_blocks` (inputs seeded
    140, draws 141); whether some of those rows of one call is not exact softmax. ``probe``: return at once where
    every one is."""
    import torch

    m = n
    rows = slice(n // 3, 3 * n // 4)
    q, k, v = _inputs(((2, n, 5), (2, m, 5), (2, m, 3)), seed=140)
    keys = rows.stop + m - n if mask is not None else m
    qb, kb, vb = q[..., rows, :], k[..., :keys, :], v[..., :keys, :]
    full = _draw(spec, q.shape, k.shape, params, seed=141, mask=mask)
    whole = _quiet(lambda: _reference(spec, q, k, v, full, params, mask=mask))
    tested = not _exact_rows(whole, q, k, v, mask)[..., rows].all()
    if probe and not tested:
        return False
    draws = _aligned_draws(full, _draw(spec, qb.shape, kb.shape, params, seed=141, mask=mask), rows, keys, n, m)
    if draws is None:
        raise CheckSkipped("the draws of a block of queries do not cut from those of every query (an axis longer "
                           f"or an array missing: { {key: np.shape(a) for key, a in full.arrays.items()} })")
    where = f"queries {rows.start}..{rows.stop - 1} of {n} with the first {keys} keys{_mask_words(mask)}"
    whole = whole[..., rows, :]
    alone = _quiet(lambda: _reference(spec, qb, kb, vb, draws, params, mask=mask))
    if not np.allclose(alone, whole, atol=1e-12, rtol=1e-12, equal_nan=True):
        diff = np.nanmax(np.abs(alone - whole))
        raise CheckFailed(f"{where}: estimated alone they differ from those rows of one call over every query "
                          f"(max {diff:.3g}, reference): the estimate of a query depends on the others present, "
                          f"which query_placement={placement!r} denies; randattn mse estimates every query of a "
                          "long layer in blocks (declare 'proportional' if the queries are pooled)")
    _close(_quiet(lambda: _batched(spec, qb, kb, vb, draws, params, dtype=torch.float64, mask=mask)),
           _quiet(lambda: _batched(spec, q, k, v, full, params, dtype=torch.float64, mask=mask))[..., rows, :],
           atol=1e-12, rtol=1e-12, what=f"{where}, batched, against those rows of one call:")
    return tested


# ---------------------------------------------------------------------------------------------------- optional forms
def _to_torch(arrays, draws, dtype):
    import torch

    return (*(torch.as_tensor(np.asarray(a), dtype=dtype) for a in arrays), draws.to_torch(dtype=dtype))


def _identity_values(k: np.ndarray) -> np.ndarray:
    """``v = I_M`` with the keys' batch dims: the values whose estimate is the implied probability matrix."""
    m = k.shape[-2]
    return np.broadcast_to(np.eye(m), (*k.shape[:-1], m)).copy()


def _optional_cases(spec: EstimatorSpec, params: Mapping[str, Any], *, seed: int):
    """For every declared mask and odd shape: ``(mask, where, (q, k, v), draws)``, float64 numpy inputs seeded
    ``seed + i`` and draws ``seed + 10 + i`` (as :func:`_reference_and_batched`)."""
    for mask in _masks(spec, params):
        for i, (label, *shapes) in enumerate(_odd_shapes(mask)):
            q, k, v = _inputs(shapes, seed=seed + i)
            draws = _draw(spec, q.shape, k.shape, params, seed=seed + 10 + i, mask=mask)
            yield mask, f"{label}{_mask_words(mask)}", (q, k, v), draws


def _recorded(func: Callable[[], Any]) -> tuple[Any, list[str]]:
    """``func()`` and the messages of the warnings it raised, each as often as raised, sorted."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = func()
    return result, sorted(str(w.message) for w in caught)


def _dense_probabilities(spec, tq, tk, tdraws, params, mask):
    """The implied probabilities by the spec's own dense route: ``forms.probabilities`` where declared, else
    ``batched`` with ``v = I_M`` (what the sweep falls back to)."""
    import torch

    kwargs = {"mask": mask} if mask is not None else {}
    if spec.forms.has("probabilities"):
        return spec.forms.get("probabilities")(tq, tk, tdraws, scale=None, **params, **kwargs)
    m = tk.shape[-2]
    eye = torch.eye(m, dtype=tk.dtype).expand(*tk.shape[:-1], m)
    return spec.batched(tq, tk, eye, tdraws, scale=None, **params, **kwargs)


def _check_tensor(what: str, value: Any, shape: tuple[int, ...], dtype: Any = None) -> None:
    import torch

    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(shape) or (
            dtype is not None and value.dtype != dtype):
        wanted = f"a {dtype} tensor" if dtype is not None else "a tensor"
        raise CheckFailed(f"{what} is {type(value).__name__} {getattr(value, 'dtype', '')} "
                          f"{tuple(getattr(value, 'shape', ()))}; expected {wanted} of shape {tuple(shape)}")


def _bits_equal(what: str, actual: Any, expected: Any) -> None:
    """The same bits (NaN where NaN), or CheckFailed saying how far apart they are."""
    import torch

    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        raise CheckFailed(f"{what}: {actual.dtype} {tuple(actual.shape)}, but the separate call gives "
                          f"{expected.dtype} {tuple(expected.shape)}")
    if not torch.equal(torch.nan_to_num(actual, nan=0.5), torch.nan_to_num(expected, nan=0.5)) or not torch.equal(
            torch.isnan(actual), torch.isnan(expected)):
        diff = np.nanmax(np.abs(to_numpy(actual) - to_numpy(expected)), initial=0.0)
        raise CheckFailed(f"{what}: not the same bits as the separate call (max |diff| {diff:.3e}); the one-pass form "
                          "must compute the same terms in the same order, or the sweep's tables change with the path")


def check_probabilities(spec: EstimatorSpec, params: Mapping[str, Any]) -> None:
    """``forms.probabilities(q, k, draws)`` is the implied attention matrix ``(R, ..., N, M)``: the reference and
    ``batched`` with ``v = I_M`` (float64, 1e-10), over odd shapes, under every declared mask."""
    import torch

    if not spec.forms.has("probabilities"):
        raise CheckSkipped("the spec declares no forms.probabilities")
    probabilities = spec.forms.get("probabilities")
    atol, rtol = TOLERANCES["float64"]
    for mask, where, (q, k, _), draws in _optional_cases(spec, params, seed=160):
        eye = _identity_values(k)
        tq, tk, tdraws = _to_torch((q, k), draws, torch.float64)
        kwargs = {"mask": mask} if mask is not None else {}
        probs = _quiet(lambda: probabilities(tq, tk, tdraws, scale=None, **params, **kwargs))
        _check_tensor(f"forms.probabilities on {where}", probs, (_REPLICATES, *q.shape[:-1], k.shape[-2]),
                      torch.float64)
        ref = _quiet(lambda: _reference(spec, q, k, eye, draws, params, mask=mask))
        _close(probs, ref, atol=atol, rtol=rtol,
               what=f"forms.probabilities against the reference with v = I_M, same draws, {where}:")
        bat = _quiet(lambda: _batched(spec, q, k, eye, draws, params, dtype=torch.float64, mask=mask))
        _close(probs, bat, atol=atol, rtol=rtol,
               what=f"forms.probabilities against batched with v = I_M, same draws, {where}:")


def check_with_probabilities(spec: EstimatorSpec, params: Mapping[str, Any]) -> None:
    """``forms.estimate_with_probabilities`` returns ``batched``'s output and ``forms.probabilities``' probabilities
    bit for bit, with the same warnings, in float64 and float32, over odd shapes, under every declared mask."""
    import torch

    if not spec.forms.has("estimate_with_probabilities"):
        raise CheckSkipped("the spec declares no forms.estimate_with_probabilities")
    with_probabilities = spec.forms.get("estimate_with_probabilities")
    for dtype in (torch.float64, torch.float32):
        for mask, where, (q, k, v), draws in _optional_cases(spec, params, seed=170):
            where = f"{where}, {dtype}"
            tq, tk, tv, tdraws = _to_torch((q, k, v), draws, dtype)
            kwargs = {"mask": mask} if mask is not None else {}
            (out, probs), joint = _recorded(
                lambda: with_probabilities(tq, tk, tv, tdraws, scale=None, **params, **kwargs))
            alone_out, out_warnings = _recorded(lambda: spec.batched(tq, tk, tv, tdraws, scale=None, **params,
                                                                     **kwargs))
            _bits_equal(f"forms.estimate_with_probabilities' output on {where}", out, alone_out)
            if not spec.forms.has("probabilities"):
                # no separate probability form: the probabilities are batched with v = I_M, to rounding
                atol, rtol = TOLERANCES["float64" if dtype == torch.float64 else "float32"]
                dense = _quiet(lambda: _dense_probabilities(spec, tq, tk, tdraws, params, mask))
                _close(probs, dense, atol=atol, rtol=rtol,
                       what=f"forms.estimate_with_probabilities' probabilities against batched with v = I_M, {where}:")
                continue
            alone_probs, probs_warnings = _recorded(
                lambda: spec.forms.get("probabilities")(tq, tk, tdraws, scale=None, **params, **kwargs))
            _bits_equal(f"forms.estimate_with_probabilities' probabilities on {where}", probs, alone_probs)
            if joint != sorted(out_warnings + probs_warnings):
                raise CheckFailed(f"forms.estimate_with_probabilities on {where} warned {joint}, but batched and "
                                  f"forms.probabilities warn {sorted(out_warnings + probs_warnings)}")


def _separate_calls(spec: EstimatorSpec) -> dict[str, Callable[..., Any]]:
    """What a one-pass form returns, part by part, as the separate calls give it: ``name -> call(tq, tk, tv, tdraws,
    kwargs)`` (the names the kit's messages use)."""
    return {
        "output": lambda tq, tk, tv, tdraws, kw: spec.batched(tq, tk, tv, tdraws, **kw),
        "probabilities": lambda tq, tk, tv, tdraws, kw: spec.forms.get("estimate_with_probabilities")(
            tq, tk, tv, tdraws, **kw)[1],
        "keys_used": lambda tq, tk, tv, tdraws, kw: spec.keys_used(tq, tk, tdraws, **kw),
        "log_denominator": lambda tq, tk, tv, tdraws, kw: spec.log_denominator(tq, tk, tdraws, **kw),
    }


#: the one-pass forms: each returns these parts of :func:`_separate_calls`, in order, from one selection
_ONE_PASS_PARTS = {
    "estimate_with_probabilities_and_keys_used": ("output", "probabilities", "keys_used"),
    "estimate_with_probabilities_keys_used_and_log_denominator": ("output", "probabilities", "keys_used",
                                                                  "log_denominator"),
}
#: the separate call each part comes from, as the kit's messages name it
_SEPARATE_NAMES = {"output": "batched", "probabilities": "forms.estimate_with_probabilities", "keys_used": "keys_used",
                   "log_denominator": "log_denominator"}


def _check_one_pass(spec: EstimatorSpec, params: Mapping[str, Any], form: str, seed: int) -> None:
    """``form`` returns the parts :data:`_ONE_PASS_PARTS` names, each bit for bit as its separate call gives it,
    warning nothing the separate calls do not, in float64 and float32, over odd shapes, under every declared mask."""
    import torch

    name = f"forms.{form}"
    if not spec.forms.has(form):
        raise CheckSkipped(f"the spec declares no {name}")
    parts = _ONE_PASS_PARTS[form]
    declared = {"probabilities": spec.forms.has("estimate_with_probabilities"),
                "keys_used": spec.keys_used is not None, "log_denominator": spec.log_denominator is not None}
    missing = [_SEPARATE_NAMES[p] for p in parts[1:] if not declared[p]]
    if missing:
        raise CheckFailed(f"{name} is declared without {' and '.join(missing)}, whose results it must give")
    calls = _separate_calls(spec)
    one_pass = spec.forms.get(form)
    for dtype in (torch.float64, torch.float32):
        for mask, where, (q, k, v), draws in _optional_cases(spec, params, seed=seed):
            where = f"{where}, {dtype}"
            tq, tk, tv, tdraws = _to_torch((q, k, v), draws, dtype)
            kwargs = {"scale": None, **params, **({"mask": mask} if mask is not None else {})}
            results, joint = _recorded(lambda: one_pass(tq, tk, tv, tdraws, **kwargs))
            separate: set[str] = set()
            for part, result in zip(parts, results):
                alone, alone_warnings = _recorded(lambda: calls[part](tq, tk, tv, tdraws, kwargs))
                separate |= set(alone_warnings)
                _bits_equal(f"{name}' {'output' if part == 'output' else part} on {where}", result, alone)
            if not set(joint) <= separate:
                names = [_SEPARATE_NAMES[p] for p in parts]
                raise CheckFailed(f"{name} on {where} warned {sorted(set(joint))}, but "
                                  f"{', '.join(names[:-1])} and {names[-1]} warn {sorted(separate)}")


def check_with_keys_used(spec: EstimatorSpec, params: Mapping[str, Any]) -> None:
    """``forms.estimate_with_probabilities_and_keys_used`` returns ``batched``'s output, the probabilities of
    ``forms.estimate_with_probabilities`` and ``keys_used``' counts bit for bit, warning nothing the three do not,
    in float64 and float32, over odd shapes, under every declared mask."""
    _check_one_pass(spec, params, "estimate_with_probabilities_and_keys_used", seed=175)


def check_with_log_denominator(spec: EstimatorSpec, params: Mapping[str, Any]) -> None:
    """``forms.estimate_with_probabilities_keys_used_and_log_denominator`` returns the three results of
    ``check_with_keys_used`` and ``log_denominator``'s values bit for bit, warning nothing the four do not, in
    float64 and float32, over odd shapes, under every declared mask."""
    _check_one_pass(spec, params, "estimate_with_probabilities_keys_used_and_log_denominator", seed=178)


def check_float32_probabilities(spec: EstimatorSpec, params: Mapping[str, Any]) -> None:
    """``forms.estimate_with_float32_probabilities`` on float64 inputs: ``out`` is ``batched``'s bits, and each row of
    the float32 probabilities lies within the returned ``bound`` of the float64 ones in the 2-norm (plus 1e-12 of
    the row's norm for float64's own rounding), over odd shapes, under every declared mask."""
    import torch

    if not spec.forms.has("estimate_with_float32_probabilities"):
        raise CheckSkipped("the spec declares no forms.estimate_with_float32_probabilities")
    with_float32_probabilities = spec.forms.get("estimate_with_float32_probabilities")
    products = 0
    for mask, where, (q, k, v), draws in _optional_cases(spec, params, seed=180):
        tq, tk, tv, tdraws = _to_torch((q, k, v), draws, torch.float64)
        kwargs = {"mask": mask} if mask is not None else {}
        result = _quiet(lambda: with_float32_probabilities(tq, tk, tv, tdraws, scale=None, **params,
                                                                        **kwargs))
        if result is None:  # no float32 product for this configuration and mask: the sweep uses the float64 one
            continue
        products += 1
        out, probs, bound = result
        rows = (_REPLICATES, *q.shape[:-1])
        _bits_equal(f"forms.estimate_with_float32_probabilities' output on {where}", out,
                    _quiet(lambda: spec.batched(tq, tk, tv, tdraws, scale=None, **params, **kwargs)))
        _check_tensor(f"forms.estimate_with_float32_probabilities' probabilities on {where}", probs,
                      (*rows, k.shape[-2]))
        _check_tensor(f"forms.estimate_with_float32_probabilities' bound on {where}", bound, rows)
        bound = to_numpy(bound)
        if np.isnan(bound).any() or (bound < 0).any():
            raise CheckFailed(f"forms.estimate_with_float32_probabilities' bound on {where} has negative or NaN "
                              "entries")
        exact = to_numpy(_quiet(lambda: _dense_probabilities(spec, tq, tk, tdraws, params, mask)))
        distance = np.linalg.norm(to_numpy(probs) - exact, axis=-1)
        allowed = bound + 1e-12 * np.linalg.norm(exact, axis=-1)
        if not (distance <= allowed).all():  # NaN distances fail too
            at = plain_index(np.argwhere(~(distance <= allowed))[0])
            raise CheckFailed(f"forms.estimate_with_float32_probabilities on {where}: row {at} of the float32 "
                              f"probabilities is {distance[at]:.3e} from the float64 ones in the 2-norm, beyond its "
                              f"bound {bound[at]:.3e}: the bound does not bound the rounding")
    if not products:
        raise CheckSkipped("forms.estimate_with_float32_probabilities returns None for this configuration (no "
                           "float32 product)")


def check_probability_factors(spec: EstimatorSpec, params: Mapping[str, Any]) -> None:
    """``forms.estimate_with_probability_factors``: ``out`` is ``batched``'s bits and ``left @ right`` is the implied
    probability matrix (float64 1e-10, float32 the float32 tolerance) with ``right`` in [0, 1], or None
    for a configuration without factors; over odd shapes, under every declared mask, in float64 and float32."""
    import torch

    if not spec.forms.has("estimate_with_probability_factors"):
        raise CheckSkipped("the spec declares no forms.estimate_with_probability_factors")
    with_probability_factors = spec.forms.get("estimate_with_probability_factors")
    factored = 0
    for dtype in (torch.float64, torch.float32):
        atol, rtol = TOLERANCES["float64" if dtype == torch.float64 else "float32"]
        for mask, where, (q, k, v), draws in _optional_cases(spec, params, seed=190):
            where = f"{where}, {dtype}"
            tq, tk, tv, tdraws = _to_torch((q, k, v), draws, dtype)
            kwargs = {"mask": mask} if mask is not None else {}
            result, factor_warnings = _recorded(
                lambda: with_probability_factors(tq, tk, tv, tdraws, scale=None, **params, **kwargs))
            if result is None:  # no factors for this configuration and mask: the sweep takes the dense route
                continue
            factored += 1
            out, left, right = result
            _bits_equal(f"forms.estimate_with_probability_factors' output on {where}", out,
                        _quiet(lambda: spec.batched(tq, tk, tv, tdraws, scale=None, **params, **kwargs)))
            rows = (_REPLICATES, *q.shape[:-1])
            if not (isinstance(left, torch.Tensor) and isinstance(right, torch.Tensor) and left.dim() == right.dim()
                    and tuple(left.shape[:-1]) == rows and tuple(right.shape[:-2]) == rows[:-1]
                    and right.shape[-1] == k.shape[-2] and left.shape[-1] == right.shape[-2]):
                left_shape, right_shape = tuple(getattr(left, "shape", ())), tuple(getattr(right, "shape", ()))
                raise CheckFailed(f"forms.estimate_with_probability_factors on {where}: left {left_shape}"
                                  f" and right {right_shape}; expected (R, ..., N, J) = "
                                  f"{(*rows, 'J')} and (R, ..., J, M) = {(*rows[:-1], 'J', k.shape[-2])}")
            # the sweep's rounding bound needs right in [0, 1] (a key softmax, or exponentials shifted to at most
            # 1); left may take any sign (signed weights)
            outside = ~((right >= 0) & (right <= 1))
            if outside.any():
                at = plain_index(torch.nonzero(outside)[0].tolist())
                raise CheckFailed(f"forms.estimate_with_probability_factors on {where}: right factor entry {at} is "
                                  f"{float(right[at])!r}, outside [0, 1]")
            dense = _quiet(lambda: _dense_probabilities(spec, tq, tk, tdraws, params, mask))
            _close(left.double() @ right.double(), dense, atol=atol, rtol=rtol,
                   what=f"forms.estimate_with_probability_factors: left @ right against the probabilities, {where}:")
            if spec.forms.has("estimate_with_probabilities"):
                _, joint_warnings = _recorded(
                    lambda: spec.forms.get("estimate_with_probabilities")(tq, tk, tv, tdraws, scale=None, **params,
                                                                          **kwargs))
                if factor_warnings != joint_warnings:
                    raise CheckFailed(f"forms.estimate_with_probability_factors on {where} warned "
                                      f"{factor_warnings}, but forms.estimate_with_probabilities warns "
                                      f"{joint_warnings}")
    if not factored:
        raise CheckSkipped("forms.estimate_with_probability_factors returns None for this configuration (no factors)")


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


def _bad_input_cases(spec: EstimatorSpec,
                     params: Mapping[str, Any]) -> list[tuple[str, Callable[[Any, Any, Any], tuple], dict, type, str]]:
    """(what, inputs from (q, k, v), extra keywords, error class, words the message must hold)."""
    nan_at_max = lambda a: np.where(a == a.max(), np.nan, a)  # noqa: E731
    inf_at_max = lambda a: np.where(a == a.max(), np.inf, a)  # noqa: E731
    cases = [
        ("q with another head dim", lambda q, k, v: (q[..., :3], k, v), {}, ValueError, "same feature dim"),
        ("v with another token count", lambda q, k, v: (q, k, v[:-1]), {}, ValueError, "same number of tokens"),
        ("NaN in q", lambda q, k, v: (nan_at_max(q), k, v), {}, ValueError, "NaN or infinite"),
        ("inf in v", lambda q, k, v: (q, k, inf_at_max(v)), {}, ValueError, "NaN or infinite"),
        ("no queries", lambda q, k, v: (q[:0], k, v), {}, ValueError, "empty sequence"),
        ("no keys", lambda q, k, v: (q, k[:0], v[:0]), {}, ValueError, "empty sequence"),
        ("integer q", lambda q, k, v: (q.astype(np.int64), k, v), {}, TypeError, "floating dtype"),
        ("q with an extra batch dim", lambda q, k, v: (q[None], k, v), {}, ValueError, "same batch dims"),
        ("a 1-D q", lambda q, k, v: (q[0], k, v), {}, ValueError, "shape (..., tokens, features)"),
        ("a list for q", lambda q, k, v: (q.tolist(), k, v), {}, TypeError, "numpy array or torch tensor"),
        ("an unknown parameter", lambda q, k, v: (q, k, v), {"no_such_parameter": 1}, ValueError,
         f"unknown parameter(s) 'no_such_parameter' for estimator '{spec.name}'"),
        ("an unknown mask", lambda q, k, v: (q, k, v), {"mask": "sideways"}, ValueError, "mask"),
        ("scale 0", lambda q, k, v: (q, k, v), {"scale": 0.0}, ValueError, "positive"),
        ("a negative scale", lambda q, k, v: (q, k, v), {"scale": -1.0}, ValueError, "positive"),
        ("a NaN scale", lambda q, k, v: (q, k, v), {"scale": float("nan")}, ValueError, "positive"),
        ("a text scale", lambda q, k, v: (q, k, v), {"scale": "x"}, TypeError, "positive real"),
    ]
    for pname, param in spec.params.items():
        if param.choices:
            cases.append((f"a value of {pname!r} outside its choices", lambda q, k, v: (q, k, v),
                          {pname: "__not_a_choice__"}, ValueError,
                          f"{pname}='__not_a_choice__' is not allowed; choose one of {param.choices[0]!r}"))
            break
    if spec.needs_samples_of(params):
        cases += [("no num_samples", lambda q, k, v: (q, k, v), {"num_samples": None}, ValueError, "needs num_samples"),
                  ("num_samples 0", lambda q, k, v: (q, k, v), {"num_samples": 0}, ValueError, ">= 1"),
                  ("a fractional num_samples", lambda q, k, v: (q, k, v), {"num_samples": 2.5}, TypeError, "integer")]
    return cases


def check_bad_inputs(spec: EstimatorSpec, params: Mapping[str, Any]) -> None:
    """Through ``randattn.estimate``, bad input raises the error class that fits (ValueError, or TypeError for a
    wrong type) with a message that names it: shapes, NaN and inf, empty inputs, dtypes, unknown parameters and
    masks, a value outside a parameter's choices (listing them), a bad scale, a bad ``num_samples``."""
    from randattn.api import estimate

    rng = np.random.default_rng(140)
    q, k, v = rng.standard_normal((3, 6, 4))
    for what, mutate, extra, error, words in _bad_input_cases(spec, params):
        qq, kk, vv = mutate(q, k, v)
        samples = _SAMPLES if spec.needs_samples_of(params) else None
        keywords = {"num_samples": samples, "seed": 0, **params, **extra}
        try:
            _quiet(lambda: estimate(spec, qq, kk, vv, **keywords))
        except (ValueError, TypeError) as exc:
            if not isinstance(exc, error):
                raise CheckFailed(f"{what}: raised {type(exc).__name__}, expected {error.__name__}: {exc}") from None
            if words not in str(exc):
                raise CheckFailed(f"{what}: the error does not name the problem (expected {words!r} in it): "
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
    "draws layout": check_draws_layout,
    "stacked draw": check_stacked_draw,
    "replicates": check_replicates,
    "float32 batched": check_float32_matches_reference,
    "probabilities": check_probabilities,
    "with probabilities": check_with_probabilities,
    "with keys used": check_with_keys_used,
    "with log denominator": check_with_log_denominator,
    "float32 probabilities": check_float32_probabilities,
    "probability factors": check_probability_factors,
    "key norms 150-200": check_finite_at_large_norms,
    "ViT-like norms": check_vit_like_norms,
    "declared convergence": check_convergence,
    "exact limits": check_exact_limits,
    "keys used": check_keys_used,
    "log denominator": check_log_denominator,
    "one key": check_single_key,
    "causal prefix invariance": check_causal_prefix_invariance,
    "sliding window": check_sliding_window,
    "query blocks": check_query_blocks,
    "no N x M memory": check_no_quadratic_memory,
    "bad inputs": check_bad_inputs,
}
