r"""Bookkeeping of the verified propositions: checks, results, inputs and Monte Carlo tolerances.

Monte Carlo tolerance policy
----------------------------
Every Monte Carlo check compares a replicate mean with its target through z-scores,
``z = (mean - target) / SE`` with ``SE = replicate std / sqrt(R)`` over R *independent*
replicates (features inside one replicate may be coupled). A check fails when
``|z| > MC_K_SE`` for any tested element (one-sided checks: ``z`` beyond ``MC_K_SE`` in the
direction of the claim's violation).

``MC_K_SE = 4.5``: the two-sided normal tail beyond 4.5 is ``6.8e-6``. Each Monte Carlo
check declares how many elements (z-scores) it tests at most, and the registry holds the
total below ``MC_TEST_BUDGET = 1470`` elements, so by Bonferroni the probability that a
*correct* implementation fails any Monte Carlo check of a full run is at most
``1470 * 6.8e-6 = 1.0%`` (the seed is fixed, so a given run is deterministic; the 1% is
over seeds). Power: a true deviation of ``(4.5 + 1.28) SE ~ 5.8 SE`` is detected with
probability >= 90%; each result states that detectable size in its own units. ``quick=True``
uses fewer replicates, so the SE (and the detectable size) grows, while the threshold stays.

The SE estimate itself is random; with ``R >= 1000`` replicates and light tails (the
inputs are chosen so that every estimator has moderate higher moments, e.g.
``|x + y|^2 <= 1`` for kernel estimates whose k-th moment grows like ``exp(k^2 |x+y|^2 / 2)``)
its relative error is a few percent, which moves the effective threshold by < 0.2 SE.
Squared deviations (the variance and MSE checks) are the exception: skewed to the right, their
studentized mean has a heavy lower tail (a run without the rare large squares has a small mean and
a small SE), so those checks take :func:`second_moment_z_scores`, Hall's skewness-corrected z.
Measured over 10,000 correct ``--quick`` runs of the five such checks (``performer.lemma2.*``,
``oprf.variance-closed-form``, ``sderf.variance-closed-form``): 5 failed, against 2.2 for normal
z-scores and 17 before the correction.
"""

from __future__ import annotations

import fnmatch
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
from scipy.special import softmax

__all__ = [
    "METHODS",
    "MC_K_SE",
    "MC_TEST_BUDGET",
    "EXACT_RTOL",
    "CheckResult",
    "Check",
    "HeadData",
    "VerifyData",
    "exact_attention",
    "second_moment_z_scores",
    "z_scores",
    "mc_unbiased_result",
    "rare_component_se_floor",
    "exact_result",
    "unit_norm_rows",
    "data_from_activations",
    "heads_or_synthetic",
    "check_rng",
    "closed_form_and_mc",
    "select_checks",
]

#: how a check decides: an identity to rounding, a closed form (or numerical optimum), or a Monte Carlo test
METHODS = ("exact identity", "closed form", "Monte Carlo")
#: z-score threshold of every Monte Carlo comparison (see module docstring)
MC_K_SE = 4.5
#: most z-scores tested over all Monte Carlo checks of a run: 1470 * 2 * sf(4.5) = 1.0% family-wise
MC_TEST_BUDGET = 1470
#: identities in float64: relative to max(1, |value|). Rounding is ~1e-16 per operation; sums over
#: a few hundred terms of magnitude up to 1e3 (ViT log-densities) stay below 1e-11.
EXACT_RTOL = 1e-10


@dataclass(frozen=True)
class CheckResult:
    """The outcome of one check.

    Attributes
    ----------
    name : str
        The check's registry name.
    measured : float
        The discrepancy (or test statistic) the decision is based on.
    tolerance : float
        The threshold it is compared with.
    passed : bool
        Whether the claim held (for "detect the bias" checks: whether the bias was detected).
    details : str
        Inputs, sample sizes, secondary numbers and the detectable effect size.
    comparison : str
        How ``measured`` is compared with ``tolerance``: ``"<="`` (most checks) or ``">="``
        (checks that must *detect* an effect).
    tested : int
        Number of tested elements (z-scores for Monte Carlo checks).
    skipped : bool
        The check could not apply here (e.g. the estimator it is about does not declare the
        mask it needs); ``details`` says why. A skipped check does not fail (``passed`` is True).
    """

    name: str
    measured: float
    tolerance: float
    passed: bool
    details: str
    comparison: str = "<="
    tested: int = 1
    skipped: bool = False

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready record."""
        return {
            "name": self.name,
            "measured": None if not np.isfinite(self.measured) else float(self.measured),
            "tolerance": float(self.tolerance),
            "comparison": self.comparison,
            "passed": bool(self.passed),
            "tested": int(self.tested),
            "skipped": bool(self.skipped),
            "details": self.details,
        }


@dataclass(frozen=True)
class HeadData:
    """One attention head's inputs for the data-dependent checks.

    Attributes
    ----------
    q : (N, D) float64
    k : (M, D) float64
    v : (M, Dv) float64
    scale : float
        Temperature: logits are ``scale q.k`` (``x = sqrt(scale) q``).
    label : str
        Where it came from, e.g. ``"layer 0 head 1"``.
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    scale: float
    label: str

    @property
    def x(self) -> np.ndarray:
        """Queries in the papers' variables, ``sqrt(scale) q``."""
        return self.q * np.sqrt(self.scale)

    @property
    def y(self) -> np.ndarray:
        """Keys in the papers' variables, ``sqrt(scale) k``."""
        return self.k * np.sqrt(self.scale)


@dataclass(frozen=True)
class VerifyData:
    """A few heads of a user's activation file, subset for speed (see :func:`data_from_activations`)."""

    heads: tuple[HeadData, ...]
    description: str


@dataclass(frozen=True)
class Check:
    """One documented, checkable claim.

    Attributes
    ----------
    name : str
        Dotted registry name, ``paper.where.what``.
    claim : str
        The statement, in words and symbols.
    source : str
        Paper and equation / proposition.
    method : str
        One of :data:`METHODS`.
    func : callable
        ``func(rng, quick, data) -> CheckResult``; the thing under test is a keyword
        parameter with a default, so that tests can inject a broken one.
    uses_data : bool
        Whether ``data`` (a :class:`VerifyData`) replaces the synthetic inputs when given.
    max_tested : int
        Monte Carlo only: the most z-scores it tests (counted against :data:`MC_TEST_BUDGET`).
    """

    name: str
    claim: str
    source: str
    method: str
    func: Callable[..., CheckResult]
    uses_data: bool = False
    max_tested: int = 0
    synthetic_note: str = field(default="")

    @property
    def method_label(self) -> str:
        """``method``, with the z threshold for Monte Carlo checks."""
        return f"Monte Carlo ({MC_K_SE:g} SE)" if self.method == "Monte Carlo" else self.method

    def run(self, rng: np.random.Generator, quick: bool = False, data: VerifyData | None = None) -> CheckResult:
        """Run the check; ``data`` is ignored by checks that need synthetic inputs."""
        return self.func(rng, quick, data if self.uses_data else None)


def check_rng(seed: int, name: str) -> np.random.Generator:
    """The generator of check ``name`` under run seed ``seed``: independent of which other checks run."""
    return np.random.default_rng(np.random.SeedSequence([int(seed), zlib.crc32(name.encode())]))


def select_checks(checks: Sequence[Check], pattern: str | None) -> list[Check]:
    """Checks whose name matches ``pattern`` (a glob; without glob characters, a substring)."""
    if pattern is None:
        return list(checks)
    glob = pattern if any(ch in pattern for ch in "*?[") else f"*{pattern}*"
    return [c for c in checks if fnmatch.fnmatchcase(c.name, glob)]


def exact_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    r"""``verify``'s own ground truth: softmax attention in float64, ``(..., N, Dv)``.

    .. math:: \mathrm{softmax}_m(\mathrm{scale}\; q_n^\top k_m)\, v_m

    Written here on purpose, from the unscaled ``q, k`` and the logit temperature, with no
    code shared with the estimators (not their input preparation, not ``softmax.reference``):
    a wrong temperature convention or a wrong preparation in the package cannot cancel out.
    """
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    logits = float(scale) * (q @ np.swapaxes(k, -1, -2))
    return softmax(logits, axis=-1) @ v


def z_scores(samples: np.ndarray, target: np.ndarray, *, floor: float = 1e-12,
             se_floor: np.ndarray | float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    r"""z-scores of replicate means against a target, and their standard errors.

    Parameters
    ----------
    samples : (R, ...)
        Independent replicates.
    target : (...)
        The exact expectation.
    floor : float
        An absolute SE floor relative to ``max(1, |target|)``: an estimator with (numerically)
        zero variance is compared to rounding, not divided by zero.
    se_floor : (...) array or float
        An absolute SE term from a closed-form bound, for what the sample SE cannot see: rare
        mixture components drawn (far) fewer times than expected (see
        :func:`rare_component_se_floor`). Added in quadrature.

    Returns
    -------
    z : (...) ; se : (...)
        .. math:: z = \frac{\bar y - t}{\sqrt{s^2/R + \text{se\_floor}^2 + (\text{floor}\,\max(1, |t|))^2}}.
    """
    r = samples.shape[0]
    se = samples.std(0, ddof=1) / np.sqrt(r)
    se_eff = np.sqrt(se**2 + np.square(se_floor) + (floor * np.maximum(1.0, np.abs(target))) ** 2)
    return (samples.mean(0) - target) / se_eff, se


def second_moment_z_scores(squares: np.ndarray, target: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    r"""z-scores of the replicate mean of squared deviations (a variance or an MSE) against its closed form, with
    Hall's correction for their skewness, and the plain standard errors.

    Squared deviations are skewed to the right, and so the plain :func:`z_scores` is not normal in its tails: a run
    without the rare large squares has a small mean *and* a small SE, and its z reached -4.5 several times as often
    as a normal z does. Hall's (1992) transformation of the studentized mean,

    .. math::
        z_H = T + \frac{\hat\gamma}{3\sqrt R} T^2 + \frac{\hat\gamma^2}{27 R} T^3 + \frac{\hat\gamma}{6\sqrt R},
        \qquad T = \frac{\bar y - t}{s / \sqrt R},\quad \hat\gamma = \frac{\frac1R\sum (y - \bar y)^3}{s^3},

    removes the skewness term of its distribution (Johnson 1978, with the cubic term that makes it monotone in T):
    the z of a correct check is normal to second order. P. Hall, "On the removal of skewness by transformation",
    J. R. Stat. Soc. B 54 (1992) 221-228; N. J. Johnson, J. Am. Stat. Assoc. 73 (1978) 536-544.

    Parameters
    ----------
    squares : (R, ...)
        Independent replicates of a squared deviation.
    target : (...)
        Its exact expectation.
    """
    r = squares.shape[0]
    mean = squares.mean(0)
    centred = squares - mean
    sd = np.sqrt((centred**2).sum(0) / (r - 1))
    se = sd / np.sqrt(r)
    # the floor of z_scores: squares without spread are compared to rounding, not divided by zero
    t = (mean - target) / np.sqrt(se**2 + (1e-12 * np.maximum(1.0, np.abs(target))) ** 2)
    gamma = (centred**3).mean(0) / np.where(sd > 0, sd, np.inf) ** 3
    lam = gamma / np.sqrt(r)
    return t + lam * t**2 / 3.0 + lam**2 * t**3 / 27.0 + lam / 6.0, se


def rare_component_se_floor(pi: np.ndarray, v: np.ndarray, draws: int, *, min_expected: float = 30.0) -> np.ndarray:
    r"""SE floor of a mean of ``draws`` values ``f(omega)``, ``omega`` from a mixture with rare components.

    A component ``m`` of mass ``pi_m`` is drawn ``Poisson(draws pi_m)`` times; when that expected
    count is small the sample variance usually misses it (nothing drawn: the sample SE can be
    tiny while the mean is off by ``pi_m |mu_m - mu|``). The count's own fluctuation moves the
    mean by :math:`\sqrt{\pi_m / \text{draws}}\; |\mu_m - \mu|`, and for a value that is a convex
    combination of the rows of ``v`` (RA's ``f_n``, LARA eq. 6), :math:`|\mu_m - \mu| \le` the
    value range of that output dimension. Summed over the rare components:

    .. math:: \mathrm{floor}_{nd}^2 = \frac{\mathrm{range}_d(v)^2}{\text{draws}} \sum_{m:\ \text{draws}\, \pi_{nm} < \text{min\_expected}} \pi_{nm}.

    Components expected ``min_expected`` (30) times or more are left to the sample SE
    (relative error ~ 1/sqrt(count)). The floor is 0 when no component is rare, so the
    synthetic checks keep their power; it makes ``z`` conservative, never anti-conservative.

    Parameters
    ----------
    pi : (N, M)
        Mixture weights per query (rows sum to one).
    v : (M, Dv)
    draws : int
        Total draws per query behind the mean (replicates x samples).

    Returns
    -------
    (N, Dv) array
    """
    pi = np.asarray(pi, dtype=np.float64)
    value_range = np.ptp(np.asarray(v, dtype=np.float64), axis=0)  # (Dv,)
    rare_mass = np.where(draws * pi < min_expected, pi, 0.0).sum(-1)  # (N,)
    return np.sqrt(rare_mass[:, None] / draws) * value_range[None, :]


def mc_unbiased_result(name: str, samples: np.ndarray, target: np.ndarray, what: str,
                       se_floor: np.ndarray | float = 0.0, *, squares: bool = False) -> CheckResult:
    """Pass when every element's |z| <= MC_K_SE; report the detectable bias at 90% power.

    ``se_floor`` (same shape as ``target``, or scalar) is added to the sample SE in quadrature
    (:func:`z_scores`). ``squares``: the samples are squared deviations, whose skewness
    :func:`second_moment_z_scores` corrects (no ``se_floor``).
    """
    if squares and np.any(se_floor):
        raise ValueError("squares takes no se_floor")
    z, se = second_moment_z_scores(samples, target) if squares else z_scores(samples, target, se_floor=se_floor)
    worst = float(np.abs(z).max())
    se = np.sqrt(se**2 + np.square(se_floor))
    detect = (MC_K_SE + 1.28) * float(se.max())
    details = (
        f"{what}; R={samples.shape[0]} replicates, {z.size} elements; max |z| at a mean off by "
        f"{float(np.abs(samples.mean(0) - target).flat[np.argmax(np.abs(z))]):.3g}; "
        f"a bias >= {detect:.3g} (5.8 SE) would be caught with 90% power"
    )
    return CheckResult(name, worst, MC_K_SE, worst <= MC_K_SE, details, tested=int(z.size))


def closed_form_and_mc(name: str, worst: float, tolerance: float, mc: CheckResult, what: str) -> CheckResult:
    """A check of a closed form (``worst`` against ``tolerance``) and of the package by Monte Carlo (``mc``): passes
    when both do. Its measured value and tolerance are the closed form's, or the Monte Carlo's max |z| against
    ``MC_K_SE`` where that part alone fails, so that the row shows what failed."""
    closed_ok = worst <= tolerance
    details = (f"{what}: {worst:.3g} <= {tolerance:g} ({'ok' if closed_ok else 'FAILED'}); Monte Carlo vs the "
               f"package: {mc.measured:.3g} {mc.comparison} {MC_K_SE:g} ({'ok' if mc.passed else 'FAILED'}; "
               f"{mc.details})")
    if closed_ok and not mc.passed:
        return CheckResult(name, mc.measured, MC_K_SE, False, details, tested=mc.tested)
    return CheckResult(name, worst, tolerance, closed_ok and mc.passed, details, tested=mc.tested)


def exact_result(name: str, actual: Any, expected: Any, what: str, rtol: float = EXACT_RTOL) -> CheckResult:
    """Pass when ``max |actual - expected| / max(1, |expected|) <= rtol``."""
    a, e = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    if a.shape != e.shape:
        return CheckResult(name, float("nan"), rtol, False, f"{what}: shape {a.shape} != {e.shape}")
    with np.errstate(invalid="ignore"):
        rel = np.abs(a - e) / np.maximum(1.0, np.abs(e))
    if not np.isfinite(rel).all():
        bad = int((~np.isfinite(rel)).sum())
        return CheckResult(name, float("nan"), rtol, False, f"{what}: {bad} non-finite values", tested=int(a.size))
    worst = float(rel.max()) if rel.size else 0.0
    return CheckResult(name, worst, rtol, worst <= rtol, f"{what}; {a.size} values, max relative difference",
                       tested=int(a.size))


def unit_norm_rows(rng: np.random.Generator, shape: tuple[int, ...], norm: float) -> np.ndarray:
    """Gaussian directions rescaled to rows of exactly ``norm``: ``(..., n, d)``.

    With ``|x| = |y| = r``, ``|x + y|^2 <= 4 r^2``: the synthetic inputs of the checks that need
    moderate higher moments choose ``r`` from that bound.
    """
    a = rng.standard_normal(shape)
    return a * (norm / np.linalg.norm(a, axis=-1, keepdims=True))


#: the token subset of data-dependent checks: this many evenly spaced tokens (CLS included)
DATA_TOKENS = 16
#: at most this many layers (the first and the last of the file) and heads per layer (the first ones)
DATA_LAYERS = 2
DATA_HEADS = 2


def data_from_activations(acts: Any, *, tokens: int = DATA_TOKENS, layers: int = DATA_LAYERS,
                          heads: int = DATA_HEADS) -> VerifyData:
    """The heads the data-dependent checks run on: image 0, the first and last layer, the first heads.

    Parameters
    ----------
    acts : randattn.activations.io.Activations
        Arrays ``(B, H, N, D)`` per layer.
    tokens : int
        ``min(tokens, N)`` evenly spaced token indices (``np.linspace(0, N - 1)``, so token 0,
        a ViT's CLS, is included), the same for queries and keys: attention among a subset of
        tokens is still softmax attention, and the checks stay fast.
    layers, heads : int
        At most ``layers`` layers (first and last of the file) and ``heads`` heads of each.

    Returns
    -------
    VerifyData
        float64 copies, ``q, k, v : (tokens, D)`` per head, with the file's scale.
    """
    layer_ids = list(acts.layers)
    chosen = sorted({layer_ids[0], layer_ids[-1]})[:layers]
    b, h, n, _ = acts.shape
    idx = np.unique(np.linspace(0, n - 1, min(tokens, n)).round().astype(int))
    out = []
    for layer in chosen:
        q, k, v = acts.qkv(layer)
        for head in range(min(heads, h)):
            out.append(HeadData(
                np.asarray(q[0, head, idx], dtype=np.float64), np.asarray(k[0, head, idx], dtype=np.float64),
                np.asarray(v[0, head, idx], dtype=np.float64), acts.scale, f"layer {layer} head {head}",
            ))
    description = (f"image 0 ({acts.images[0] if acts.images else '?'}), layers {chosen}, heads 0..{min(heads, h) - 1}, "
                   f"{len(idx)} of {n} evenly spaced tokens")
    return VerifyData(tuple(out), description)


def heads_or_synthetic(data: VerifyData | None, synthetic: Callable[[], Sequence[HeadData]]) -> tuple[tuple[HeadData, ...], str]:
    """The user's heads when given, else the synthetic ones; and a phrase saying which."""
    if data is not None:
        return data.heads, f"user data: {data.description}"
    heads = tuple(synthetic())
    return heads, "synthetic inputs"
