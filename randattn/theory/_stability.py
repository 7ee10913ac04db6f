r"""Numerical stability at ViT norms: every registered estimator, float32 and float64.

ViT keys reach norms of ~150 (ARCHITECTURE sec. 3): ``exp(x.y)`` and the random features
``exp(w.y - |y|^2/2)`` then over/underflow unless every exponential meets a log-sum-exp. The
check runs each estimator of :func:`randattn.estimators.registry.list_estimators` (with its
default parameters and every registered variant) on keys of norms 150..160 and queries of
norms 100..150 at the ViT temperature ``D^-1/2``:

- the float64 reference, the float64 batched (torch) form and the float32 batched form are
  all finite (no NaN, no inf, no silent overflow);
- batched float64 equals the reference to ``1e-9`` of the value scale ``max |v|``;
- batched float32 equals the reference to ``FLOAT32_TOL = 1e-3`` of ``max |v|`` (logits of
  magnitude ~3000 carry an absolute float32 rounding of ~2e-4, which moves softmax weights by
  as much relatively; measured worst case 5e-5);
- an estimator whose spec declares the configuration exact (``softmax``) equals ``verify``'s
  own ground truth (:func:`~randattn.theory._base.exact_attention`) to the same
  tolerances.

Every function has the signature ``(rng, quick, data, *, <thing under test>=default)``.
"""

from __future__ import annotations

import warnings
from typing import Callable

import numpy as np

from randattn.theory._base import CheckResult, exact_attention, unit_norm_rows

#: float64 batched vs float64 reference, relative to max |v|
FLOAT64_TOL = 1e-9
#: float32 batched vs float64 reference, relative to max |v|
FLOAT32_TOL = 1e-3


def _large_norm_inputs(rng: np.random.Generator, n: int = 12, d: int = 16, dv: int = 4):
    """q (N, D) of norms 100..150, k (N, D) of norms 150..160 (ViT scale), v (N, Dv) standard normal."""
    q = unit_norm_rows(rng, (n, d), 1.0) * np.linspace(100.0, 150.0, n)[:, None]
    k = unit_norm_rows(rng, (n, d), 1.0) * np.linspace(150.0, 160.0, n)[:, None]
    return q, k, rng.standard_normal((n, dv)), d**-0.5


def _tokens(params: dict, default: int = 12) -> int:
    """N = M of the inputs a configuration runs on: ``default``, or ``prefix_tokens + h w`` for a patch-grid variant
    (``grid="HxW"``), whose layout holds that many tokens and refuses others."""
    from randattn.estimators.grid import parse_grid

    grid = parse_grid(params.get("grid"))
    return default if grid is None else int(params.get("prefix_tokens", 0)) + grid[0] * grid[1]


def _registered() -> list[tuple[str, str, dict]]:
    """(estimator, variant label, params) for every registered estimator and variant."""
    from randattn.estimators.registry import get_spec, list_estimators

    out = []
    for name in list_estimators():
        spec = get_spec(name)
        variants = {"default": {}, **{k: dict(p) for k, p in spec.variants.items()}}
        for label, params in variants.items():
            out.append((name, label, params))
    return out


def _is_exact(name: str, params: dict) -> bool:
    """Whether the spec declares this configuration exact softmax attention (then it must also equal
    ``verify``'s own ground truth, not only its own reference)."""
    from randattn.estimators.registry import get_spec

    try:
        spec = get_spec(name)
    except ValueError:  # an injected ``run_fn`` may test a name the registry does not hold: nothing declares it exact
        return False
    return spec.convergence_of(spec.resolve_params(params)) == "exact"


def _run_all(name: str, params: dict, q, k, v, scale: float, rng: np.random.Generator):
    """(reference float64, batched float64, batched float32) outputs as float64 numpy ``(R, N, Dv)``."""
    import torch

    from randattn.estimators.registry import get_spec

    spec = get_spec(name)
    resolved = spec.resolve_params(params)
    draws = spec.draw(q.shape, k.shape, num_samples=16, replicates=2, rng=rng, **resolved)  # whole Quest pages of 16
    with warnings.catch_warnings():
        # signed estimators may warn about non-positive normalizers; finiteness is checked below
        warnings.simplefilter("ignore")
        ref = np.asarray(spec.reference(q, k, v, draws, scale=scale, **resolved), dtype=np.float64)
        outs = [ref]
        for dtype in (torch.float64, torch.float32):
            t = [torch.as_tensor(a, dtype=dtype) for a in (q, k, v)]
            # the draws as torch tensors of the run's dtype, as the kit and randattn.estimate give them: a plugin's
            # batched form need not take numpy arrays
            tdraws = draws.to_torch(dtype=dtype)
            outs.append(spec.batched(*t, tdraws, scale=scale, **resolved).detach().cpu().double().numpy())
    return outs


def large_norm_stability(rng: np.random.Generator, quick: bool, data, *,
                         run_fn: Callable = _run_all, estimators: list | None = None) -> CheckResult:
    r"""Every registered estimator is finite at key norms >= 150 in float32 and float64, and its
    float64 batched / float32 batched forms agree with the float64 reference (module docstring).

    ``quick`` runs the default parameters of each estimator only; a full run adds every
    registered variant. Measured: the worst deviation divided by its tolerance (<= 1 passes).
    """
    entries = estimators if estimators is not None else _registered()
    if quick:
        entries = [e for e in entries if e[1] == "default"]
    # 12 tokens, and a grid variant's own count (its layout refuses others): made in this order, 12 first
    sizes = sorted({_tokens(params) for _, _, params in entries} | {12}, key=lambda n: (n != 12, n))
    inputs = {n: _large_norm_inputs(rng, n) for n in sizes}
    worst, where, problems = 0.0, "", []
    for name, label, params in entries:
        q, k, v, scale = inputs[_tokens(params)]
        vmax = float(np.abs(v).max())
        truth = exact_attention(q, k, v, scale)
        try:
            ref, b64, b32 = run_fn(name, params, q, k, v, scale, np.random.default_rng(rng.integers(2**63)))
        except Exception as exc:  # one estimator's error is its own failure, named; the others are still measured
            problems.append(f"{name}[{label}]: raised {type(exc).__name__}: {exc}")
            worst, where = (worst, where) if worst == np.inf else (np.inf, f"{name}[{label}] raised")
            continue
        if not all(np.isfinite(a).all() for a in (ref, b64, b32)):
            bad = [dt for dt, a in (("reference", ref), ("float64", b64), ("float32", b32)) if not np.isfinite(a).all()]
            problems.append(f"{name}[{label}]: non-finite output ({', '.join(bad)})")
            worst, where = (worst, where) if worst == np.inf else (np.inf, f"{name}[{label}] non-finite")
            continue
        ratios = {
            "batched float64 vs reference": np.abs(b64 - ref).max() / vmax / FLOAT64_TOL,
            "batched float32 vs reference": np.abs(b32 - ref).max() / vmax / FLOAT32_TOL,
        }
        if _is_exact(name, params):
            ratios["reference vs verify's exact softmax"] = np.abs(ref - truth).max() / vmax / FLOAT64_TOL
            ratios["float32 vs verify's exact softmax"] = np.abs(b32 - truth).max() / vmax / FLOAT32_TOL
        for what, ratio in ratios.items():
            if ratio > worst:
                worst, where = float(ratio), f"{name}[{label}] {what}"
            if ratio > 1.0:
                problems.append(f"{name}[{label}]: {what} off by {ratio:.3g} x tolerance")
    grids = ", ".join(str(n) for n in sizes if n != 12)
    details = (f"{len(entries)} estimator configurations, N = M = 12" + (f" ({grids} for the patch-grid variants)"
                                                                          if grids else "")
               + ", D = 16, key norms 150..160, query norms "
               f"100..150, scale D^-1/2; tolerances {FLOAT64_TOL:g} (float64) and {FLOAT32_TOL:g} (float32) of max|v|; "
               f"worst: {where or 'none'}" + ("; " + "; ".join(problems[:5]) if problems else ""))
    return CheckResult("numerics.large-norm-stability", worst, 1.0, worst <= 1.0 and not problems, details,
                       tested=len(entries))
