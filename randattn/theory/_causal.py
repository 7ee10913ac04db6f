r"""Causal masks (ARCHITECTURE sec. 12): the one rule, prefix invariance, the last query, EVA's full window.

Under ``mask="causal"`` key m is visible to query n iff :math:`m \le n + (M - N)`
(:func:`randattn.estimators.masks.causal_visible`). The checks here hold every registered estimator
whose spec declares causal support (:attr:`~randattn.estimators.base.EstimatorSpec.masks`), built-in or
plugin, to what that rule implies:

- :func:`prefix_invariance`: output n depends on keys and values :math:`0 .. n + M - N` only;
- :func:`mask_rule`: the package's exact causal softmax (the softmax estimator's reference and batched
  forms, and the sweep's ground truth) equals an explicit loop over the visible keys written here;
- :func:`last_query_is_bidirectional`: the last query of a causal self-attention sees every key, so
  with the same draws it equals the bidirectional output;
- :func:`eva_full_window_is_causal_softmax`: causal EVA whose local window covers the whole past has
  nothing left for its control variates (EVA app. D, Alg. 2).

Expected values come from formulas written here (the loop), never from the code under test. Every
function has the signature ``(rng, quick, data, *, <thing under test>=default)``; the tests inject a
broken one (an estimator that looks at later keys, off-by-one masks, a window that misses keys) and
assert that the check fails.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from randattn.theory._base import EXACT_RTOL, CheckResult, exact_result

#: shapes (N queries, M keys) the checks run on: self-attention, and queries that are the last N of M tokens
SHAPES = ((8, 8), (6, 9))
#: head dim, value dim and samples of the synthetic inputs
D, DV, SAMPLES = 5, 3, 4
#: the scale of the junk written over the keys and values a query must not see (large, finite)
JUNK_SCALE = 30.0
#: registered variants per estimator in quick mode (all in a full run), besides the defaults
QUICK_VARIANTS = 1


# ---------------------------------------------------------------------------------------------- inputs, the loop
def _inputs(rng: np.random.Generator, n: int, m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """q (N, D), k (M, D), v (M, Dv) of moderate norms, and the ViT temperature ``D^-1/2``."""
    return (0.7 * rng.standard_normal((n, D)), 0.7 * rng.standard_normal((m, D)), rng.standard_normal((m, DV)),
            D**-0.5)


def loop_causal_softmax(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float,
                        last_key: Callable[[int, int, int], int] | None = None) -> np.ndarray:
    r"""Causal softmax attention ``(N, Dv)`` by an explicit loop over queries and their visible keys.

    .. math:: y_n = \sum_{m=0}^{L_n}
        \frac{\exp(s\, q_n \cdot k_m - c_n)}{\sum_{m'=0}^{L_n} \exp(s\, q_n \cdot k_{m'} - c_n)}\, v_m,
        \qquad L_n = n + M - N,

    with :math:`c_n` the largest visible logit; Python floats and ``math.exp``, no array softmax.
    ``last_key(n, N, M)`` replaces :math:`L_n` (the tests' off-by-one masks).
    """
    num_q, num_k = len(q), len(k)
    out = np.zeros((num_q, v.shape[1]))
    for n in range(num_q):
        last = n + num_k - num_q if last_key is None else last_key(n, num_q, num_k)
        logits = [scale * float(np.dot(q[n], k[j])) for j in range(last + 1)]
        top = max(logits)
        weights = [math.exp(x - top) for x in logits]
        total = math.fsum(weights)
        for j, w in enumerate(weights):
            out[n] += (w / total) * v[j]
    return out


# ---------------------------------------------------------------------------------------------- the estimators
def causal_estimators(names: Sequence[str] | None = None) -> list[tuple[str, Any]]:
    """(name, spec) of the registered estimators whose spec declares ``"causal"``, in catalogue order."""
    from randattn.estimators.registry import get_spec, list_estimators

    chosen = list_estimators() if names is None else list(names)
    return [(name, get_spec(name)) for name in chosen if get_spec(name).supports_mask("causal")]


def _configurations(spec: Any, quick: bool) -> list[tuple[str, dict]]:
    """(variant, resolved params) of the defaults and the registered variants (the first few in quick mode)."""
    variants = list({"default": {}, **dict(spec.variants)}.items())
    if quick:
        variants = variants[: 1 + QUICK_VARIANTS]
    return [(name, spec.resolve_params(params)) for name, params in variants]


def _causal_draws(spec: Any, q: np.ndarray, k: np.ndarray, params: Mapping[str, Any], rng: np.random.Generator):
    """The draws of one causal call, or None when this configuration refuses the mask (its own ValueError)."""
    try:
        return spec.draw(q.shape, k.shape, num_samples=SAMPLES, replicates=2, rng=rng, mask="causal", **params)
    except ValueError:
        return None


def run_reference(spec: Any, q, k, v, draws, params: Mapping[str, Any], scale: float,
                  mask: str | None = "causal") -> np.ndarray:
    """The spec's float64 reference ``(R, N, Dv)``, with ``mask=`` only when it is set (the protocol)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # signed variants may warn of non-positive normalizers; values are compared
        return np.asarray(spec.reference(q, k, v, draws, scale=scale, **params,
                                         **({} if mask is None else {"mask": mask})), dtype=np.float64)


def run_batched(spec: Any, q, k, v, draws, params: Mapping[str, Any], scale: float,
                mask: str | None = "causal") -> np.ndarray:
    """The spec's batched torch form in float64, as numpy ``(R, N, Dv)``."""
    import torch

    t = [torch.as_tensor(a, dtype=torch.float64) for a in (q, k, v)]
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        out = spec.batched(*t, draws.to_torch(dtype=torch.float64), scale=scale, **params,
                           **({} if mask is None else {"mask": mask}))
    return out.detach().cpu().numpy()


# ---------------------------------------------------------------------------------------------- (a) prefix
def prefix_invariance(rng: np.random.Generator, quick: bool, data, *, run: Callable[..., np.ndarray] = run_reference,
                      run_fast: Callable[..., np.ndarray] | None = run_batched,
                      estimators: Sequence[str] | None = None) -> CheckResult:
    r"""A causal estimator's output n depends on keys and values :math:`0 .. n + M - N` only (ARCHITECTURE sec. 12).

    For every registered estimator declaring causal support (its defaults and registered variants;
    configurations that refuse the mask by their own ValueError are skipped and counted) and the same
    draws, the keys and values after a cut c are replaced by junk (:data:`JUNK_SCALE` times a normal
    draw); every query whose last visible key is at most c (:math:`n + M - N \le c`) must keep its
    output **bit-identical** in the float64 reference (``run``) and, in a full run, within ``EXACT_RTOL``
    in the float64 batched form (``run_fast``). The cuts are every query's last visible key (each query
    is then tested with junk right after its past), three of them in quick mode. Measured: the largest change of a
    protected output, relative to ``max(1, |y|)``.
    """
    worst, where, problems, checked, refused = 0.0, "", [], 0, 0
    for name, spec in causal_estimators(estimators):
        for variant, params in _configurations(spec, quick):
            for n_q, n_k in SHAPES:
                q, k, v, scale = _inputs(rng, n_q, n_k)
                draws = _causal_draws(spec, q, k, params, np.random.default_rng(rng.integers(2**63)))
                if draws is None:
                    refused += 1
                    continue
                checked += 1
                # the batched form in a full run only: quick mode stays within a second (torch calls cost ~30 ms)
                fast = run_fast is not None and not quick
                forms = [("reference", run, 0.0)] + ([("batched float64", run_fast, EXACT_RTOL)] if fast else [])
                last = np.arange(n_q) + n_k - n_q  # each query's last visible key
                cuts = last if not quick else last[[0, n_q // 2, n_q - 2]]  # the last query sees every key: no junk
                for form, fn, tol in forms:
                    clean = fn(spec, q, k, v, draws, params, scale)
                    for cut in cuts[cuts < n_k - 1]:
                        k_junk, v_junk = k.copy(), v.copy()
                        k_junk[cut + 1:] = JUNK_SCALE * rng.standard_normal(k_junk[cut + 1:].shape)
                        v_junk[cut + 1:] = JUNK_SCALE * rng.standard_normal(v_junk[cut + 1:].shape)
                        protected = last <= cut
                        junk = fn(spec, q, k_junk, v_junk, draws, params, scale)[:, protected]
                        kept = clean[:, protected]
                        with np.errstate(invalid="ignore"):
                            change = float(np.max(np.abs(junk - kept) / np.maximum(1.0, np.abs(kept))))
                        if not np.isfinite(change):
                            change = math.inf
                        if change > worst:
                            worst, where = change, f"{name}[{variant}] {form}, N={n_q} M={n_k}, keys after {cut}"
                        if change > tol:
                            problems.append(f"{name}[{variant}] {form}: outputs 0..{int(protected.sum()) - 1} "
                                            f"(N={n_q}, M={n_k}) changed by {change:.3g} when keys after {cut} changed")
                            break
    details = (f"{checked} (configuration, shape) pairs of {len(causal_estimators(estimators))} causal estimators, "
               f"shapes {list(SHAPES)}, junk of scale {JUNK_SCALE:g} after {'3 cuts' if quick else 'every cut'}; "
               "reference bit-identical"
               + ("" if quick or run_fast is None else f", batched float64 within {EXACT_RTOL:g}")
               + f"; {refused} refused the mask by their own check; "
               f"largest change: {where or 'none'}" + ("; " + "; ".join(problems[:4]) if problems else ""))
    return CheckResult("causal.prefix-invariance", worst, 0.0, not problems and checked > 0, details, tested=checked)


# ---------------------------------------------------------------------------------------------- (b) the rule
def _package_exact(q, k, v, scale) -> dict[str, np.ndarray]:
    """The package's exact causal softmax attention ``(N, Dv)`` by every path that computes it."""
    import torch

    from randattn.analysis.exact_cache import exact_under_mask
    from randattn.estimators.registry import get_spec

    spec = get_spec("softmax")
    t = [torch.as_tensor(a, dtype=torch.float64) for a in (q, k, v)]
    return {
        "softmax reference": np.asarray(spec.reference(q, k, v, scale=scale, mask="causal"), dtype=np.float64),
        "softmax batched float64": spec.batched(*t, scale=scale, mask="causal").numpy(),
        "sweep ground truth (numpy)": exact_under_mask("causal", q[None], k[None], v[None], scale)[1][0],
        "sweep ground truth (torch)": exact_under_mask("causal", q[None], k[None], v[None], scale, torch=torch)[1][0],
    }


def _loop_visible(n_q: int, n_k: int) -> np.ndarray:
    """The visible set as the loop walks it: key j for j in range(n + M - N + 1)."""
    visible = np.zeros((n_q, n_k), dtype=bool)
    for n in range(n_q):
        for j in range(n + n_k - n_q + 1):
            visible[n, j] = True
    return visible


def mask_rule(rng: np.random.Generator, quick: bool, data, *, visible: Callable[[int, int], np.ndarray] | None = None,
              implementations: Callable[..., Mapping[str, np.ndarray]] = _package_exact) -> CheckResult:
    r"""The causal mask is one rule: :math:`m \le n + (M - N)`, and the exact causal softmax follows it.

    ``visible`` (default :func:`randattn.estimators.masks.causal_visible`) must equal the set an explicit
    loop walks, and every ``implementations`` path of the exact causal softmax (the softmax estimator's
    reference and float64 batched forms, the sweep's ground truth in numpy and torch) must equal
    :func:`loop_causal_softmax` to ``EXACT_RTOL``, on N == M and on N < M.
    """
    from randattn.estimators.masks import causal_visible

    visible = causal_visible if visible is None else visible
    results, problems = [], []
    for n_q, n_k in SHAPES:
        rule = np.asarray(visible(n_q, n_k), dtype=bool)
        expected_set = _loop_visible(n_q, n_k)
        if rule.shape != expected_set.shape or not np.array_equal(rule, expected_set):
            wrong = int(np.sum(rule != expected_set)) if rule.shape == expected_set.shape else rule.size
            problems.append(f"the rule's visible set differs from the loop's in {wrong} entries (N={n_q}, M={n_k})")
        q, k, v, scale = _inputs(rng, n_q, n_k)
        expected = loop_causal_softmax(q, k, v, scale)
        for what, actual in implementations(q, k, v, scale).items():
            result = exact_result("causal.mask-rule", actual, expected, f"{what}, N={n_q} M={n_k}")
            results.append(result)
            if not result.passed:
                problems.append(f"{what} (N={n_q}, M={n_k}): max relative difference {result.measured:.3g}")
    measured = max((r.measured if np.isfinite(r.measured) else math.inf for r in results), default=math.nan)
    if problems and not measured > EXACT_RTOL:
        measured = math.inf  # the visible set itself is wrong
    details = (f"rule m <= n + M - N against an explicit loop, shapes {list(SHAPES)}; {len(results)} exact softmax "
               f"paths against the loop's float64 softmax" + ("; " + "; ".join(problems[:4]) if problems else ""))
    return CheckResult("causal.mask-rule", measured, EXACT_RTOL, not problems, details, tested=len(results))


# ---------------------------------------------------------------------------------------------- (c) last query
def last_query_is_bidirectional(rng: np.random.Generator, quick: bool, data, *,
                                run: Callable[..., np.ndarray] = run_reference,
                                estimators: Sequence[str] | None = None) -> CheckResult:
    r"""The last query of a causal self-attention sees every key: with the same draws it is the bidirectional output.

    For N == M the last query's visible keys are all M keys, so every causal estimator's output N - 1
    must equal the bidirectional output N - 1 computed from the same draws, to ``EXACT_RTOL`` (different
    code paths, e.g. prefix sums against full sums). Self-attention only: a bidirectional estimator with
    windows places N != M queries by their index, not as the last N tokens, so the two forms do not
    describe the same attention there.
    """
    n = SHAPES[0][0]
    worst, where, problems, checked = 0.0, "", [], 0
    for name, spec in causal_estimators(estimators):
        for variant, params in _configurations(spec, quick):
            q, k, v, scale = _inputs(rng, n, n)
            draws = _causal_draws(spec, q, k, params, np.random.default_rng(rng.integers(2**63)))
            if draws is None:
                continue
            checked += 1
            causal = run(spec, q, k, v, draws, params, scale, mask="causal")[:, -1]
            bidirectional = run(spec, q, k, v, draws, params, scale, mask=None)[:, -1]
            result = exact_result("causal.last-query-bidirectional", causal, bidirectional, f"{name}[{variant}]")
            measured = result.measured if np.isfinite(result.measured) else math.inf
            if measured > worst:
                worst, where = measured, f"{name}[{variant}]"
            if not result.passed:
                problems.append(f"{name}[{variant}]: last query differs by {measured:.3g} (relative)")
    details = (f"{checked} causal configurations, N = M = {n}, the same draws for both masks; largest relative "
               f"difference at {where or 'none'}" + ("; " + "; ".join(problems[:4]) if problems else ""))
    return CheckResult("causal.last-query-bidirectional", worst, EXACT_RTOL, not problems and checked > 0, details,
                       tested=checked)


# ---------------------------------------------------------------------------------------------- (d) EVA
def _eva_full_window(n: int, m: int) -> dict[str, Any]:
    """EVA's parameters whose local block holds every key (and the paper's disjoint partition): no chunks remain."""
    return {"window": max(n, m), "layout": "sequence", "partition": "paper"}


def eva_full_window_is_causal_softmax(rng: np.random.Generator, quick: bool, data, *,
                                      params_for: Callable[[int, int], Mapping[str, Any]] = _eva_full_window,
                                      estimator: str = "eva") -> CheckResult:
    r"""Causal EVA whose local window covers the whole past equals causal softmax attention (EVA app. D, Alg. 2).

    Under the causal mask :math:`E^n` is the visible part of query n's block; with one block of every
    key that is all of :math:`0 .. n + M - N`, no chunk lies before it, and EVA is exact. Compared with
    :func:`loop_causal_softmax` to ``EXACT_RTOL`` for every chunk weight, on N == M and N < M.
    Skipped (with the reason) when ``estimator`` is not registered or its spec does not declare
    causal support.
    """
    from randattn.estimators.registry import get_spec

    name = "causal.eva-full-window"
    try:
        spec = get_spec(estimator)
    except ValueError:
        return CheckResult(name, math.nan, EXACT_RTOL, True, f"skipped: estimator {estimator!r} is not registered",
                           tested=0, skipped=True)
    if not spec.supports_mask("causal"):
        supported = ", ".join("none" if m is None else repr(m) for m in spec.masks)
        why = f"skipped: estimator {estimator!r} does not declare mask='causal' (it supports: {supported})"
        return CheckResult(name, math.nan, EXACT_RTOL, True, why, tested=0, skipped=True)
    weights = spec.params["chunk_weight"].choices if "chunk_weight" in spec.params else (None,)
    results, problems = [], []
    for n_q, n_k in SHAPES:
        q, k, v, scale = _inputs(rng, n_q, n_k)
        expected = loop_causal_softmax(q, k, v, scale)
        for weight in weights:
            chosen = {} if weight is None else {"chunk_weight": weight}
            params = spec.resolve_params({**params_for(n_q, n_k), **chosen})
            draws = spec.draw(q.shape, k.shape, num_samples=SAMPLES, replicates=2,
                              rng=np.random.default_rng(rng.integers(2**63)), mask="causal", **params)
            actual = run_reference(spec, q, k, v, draws, params, scale)
            what = f"chunk_weight={weight}, N={n_q} M={n_k}"
            result = exact_result(name, actual, np.broadcast_to(expected, actual.shape), what)
            results.append(result)
            if not result.passed:
                problems.append(f"{what}: max relative difference {result.measured:.3g}")
    measured = max((r.measured if np.isfinite(r.measured) else math.inf for r in results), default=math.nan)
    details = (f"{estimator} with {params_for(*SHAPES[0])} under mask='causal', {len(results)} (chunk weight, shape) "
               "pairs against the explicit causal softmax loop" + ("; " + "; ".join(problems[:4]) if problems else ""))
    return CheckResult(name, measured, EXACT_RTOL, not problems, details, tested=len(results))
