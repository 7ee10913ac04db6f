r"""The decode-time sparse and sampling estimators (ARCHITECTURE sec. 14): their exact limits and their sampling laws.

- :func:`budget_covers_every_key`: every registered estimator that reports the keys it reads (``keys_used``)
  equals causal softmax attention, written out as a loop here, when its budget covers every visible key (its
  declared exact limits), in the decode regime (the last N of M tokens) and in self-attention.
- :func:`magicpig_inclusion_probability`: MagicPIG's own sampler and weights (``reference.select``) against the
  binomial tail of eq. 10 written out here: the weights exactly, the inclusion rate by Monte Carlo.
- :func:`vattention_clt_budget`: vAttention's budget theorem for the denominator holds to its Berry-Esseen bound
  with the package's sampler; :func:`vattention_one_sided_quantile_detected`: the official code's one-sided
  quantile does not.

Expected values come from formulas written here, never from the code under test. Every function has the signature
``(rng, quick, data, *, <thing under test>=default)`` so that the tests can inject a broken one.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

import numpy as np

from randattn.theory._base import MC_K_SE, CheckResult, closed_form_and_mc, exact_result
from randattn.theory._causal import loop_causal_softmax

#: (N queries, M keys): the decode regime (a few last queries of a longer cache) and self-attention
DECODE_SHAPES = ((3, 24), (10, 10))
#: the exact limits hold to a few roundings: the kept keys' softmax is the full softmax
LIMIT_RTOL = 1e-12
D, DV = 6, 3


def budget_estimators(names: Sequence[str] | None = None) -> list[tuple[str, Any]]:
    """(name, spec) of the registered estimators that declare ``keys_used`` and exact limits, in catalogue order."""
    from randattn.estimators.registry import get_spec, list_estimators

    chosen = list_estimators() if names is None else list(names)
    return [(name, get_spec(name)) for name in chosen
            if get_spec(name).keys_used is not None and get_spec(name).exact_limits]


def _limit_outputs(spec: Any, q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, mask: str | None,
                   rng: np.random.Generator):
    """Yield ``(description, reference, batched)`` outputs ``(N, Dv)`` of replicate 0 at each declared exact limit."""
    import torch

    kwargs = {"mask": mask} if mask is not None else {}
    for limit in spec.exact_limits:
        limit_params, samples = limit.resolve(len(q), len(k))
        params = spec.resolve_params(limit_params)
        draws = spec.draw(q.shape, k.shape, num_samples=(samples or len(k)) if spec.needs_samples_of(params) else None,
                          replicates=2, rng=rng, **params, **kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = spec.reference(q, k, v, draws, scale=scale, **params, **kwargs)[0]
            bat = spec.batched(*(torch.as_tensor(a) for a in (q, k, v)), draws.to_torch(), scale=scale, **params,
                               **kwargs)[0].numpy()
        yield limit.description, ref, bat


def budget_covers_every_key(rng: np.random.Generator, quick: bool, data: Any = None, *,
                            estimators: Sequence[tuple[str, Any]] | None = None) -> CheckResult:
    """At a budget covering every visible key, each budgeted estimator is causal softmax (the loop), to 1e-12."""
    name = "decode.budget-covers-every-key"
    chosen = budget_estimators() if estimators is None else list(estimators)
    if not chosen:
        return CheckResult(name, float("nan"), LIMIT_RTOL, True, "no registered estimator reports keys_used",
                           skipped=True)
    actual, expected, covered = [], [], []
    worst, where = -1.0, ""
    for n, m in DECODE_SHAPES:
        q, k, v = 0.8 * rng.standard_normal((n, D)), 0.8 * rng.standard_normal((m, D)), rng.standard_normal((m, DV))
        truth = loop_causal_softmax(q, k, v, D**-0.5)
        for est, spec in chosen:
            if not spec.supports_mask("causal"):
                continue
            for description, ref, bat in _limit_outputs(spec, q, k, v, D**-0.5, "causal", rng):
                actual += [ref, bat]
                expected += [truth, truth]
                covered.append(f"{est} ({description})")
                for form, out in (("reference", ref), ("batched", bat)):
                    with np.errstate(invalid="ignore"):  # NaN: as bad as it gets, so named
                        gap = float(np.nan_to_num(np.abs(out - truth) / np.maximum(1.0, np.abs(truth)), nan=np.inf,
                                                  posinf=np.inf).max())
                    if gap > worst:
                        worst, where = gap, f"{est} {form}, {n} x {m} ({description})"
    # the estimator that moved furthest from softmax is named, so that a plugin's failure reads as the plugin's
    return exact_result(name, np.concatenate([a.ravel() for a in actual]),
                        np.concatenate([e.ravel() for e in expected]),
                        f"{len(set(covered))} limits of {len(chosen)} estimators ({', '.join(e for e, _ in chosen)}), "
                        f"reference and batched, causal N x M = {', '.join(f'{n} x {m}' for n, m in DECODE_SHAPES)}; "
                        f"worst: {where or 'none'}", rtol=LIMIT_RTOL)


# ---------------------------------------------------------------------------------------------- MagicPIG
#: MagicPIG's hash: K bits per table, tables in the Monte Carlo, angles between query and key
SIMHASH_BITS, SIMHASH_TABLES = 3, 20_000
SIMHASH_ANGLES = (0.2, 0.6, 1.0, 1.5, 2.2, 2.8)


def _simhash_agreement(rng: np.random.Generator, quick: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(agree (T, A), x (D,), keys (A, D))``: whether the K-bit sign codes of the query and of each key agree in
    each of T independent tables of Gaussian hyperplanes -- SimHash written out here (Charikar 2002)."""
    tables = SIMHASH_TABLES // (4 if quick else 1)
    x = np.zeros(D)
    x[0] = 1.0
    keys = np.zeros((len(SIMHASH_ANGLES), D))
    keys[:, 0], keys[:, 1] = np.cos(SIMHASH_ANGLES), np.sin(SIMHASH_ANGLES)
    keys *= 1.0 + np.arange(len(SIMHASH_ANGLES))[:, None]  # norms differ: the codes depend on the angle alone
    planes = rng.standard_normal((tables, SIMHASH_BITS, D))
    query_code = planes @ x > 0  # (T, K)
    key_codes = np.einsum("tkd,ad->tak", planes, keys) > 0  # (T, A, K)
    return (key_codes == query_code[:, None, :]).all(-1).astype(np.float64), x, keys


def magicpig_collision_probability(rng: np.random.Generator, quick: bool, data: Any = None, *,
                                   exponent_offset: int = 0) -> CheckResult:
    """The fraction of tables where a query's and a key's SimHash codes agree is the package's closed form
    ``(1 - theta/pi)^K`` (MagicPIG sec. 4.3, eq. 10), within the Monte Carlo tolerance.

    The agreements of each angle are a binomial count, tested exactly: z is the normal quantile of the two-sided
    binomial p-value under the closed form, so |z| > 4.5 has the normal tail's probability. The replicate SE of
    :func:`~randattn.theory._base.z_scores` does not serve here: at 2.8 rad a quick run expects 6.4 agreements,
    and a run that saw 1 divided by an SE of one agreement (z = -5.4, in 1.2 % of correct runs).

    ``exponent_offset`` raises the exponent of the closed form under test (the negative control uses 1)."""
    from scipy.stats import binomtest, norm

    from randattn.estimators.magicpig.reference import log_table_collision_probability

    agree, x, keys = _simhash_agreement(rng, quick)
    closed = np.exp(log_table_collision_probability(x, keys, SIMHASH_BITS + exponent_offset))
    tables, counts = agree.shape[0], agree.sum(0).astype(int)
    p_values = np.array([binomtest(int(c), tables, float(p)).pvalue for c, p in zip(counts, closed)])
    z = np.sign(counts / tables - closed) * norm.isf(p_values / 2.0)
    worst = float(np.abs(z).max())
    return CheckResult("decode.magicpig-collision-probability", worst, MC_K_SE, worst <= MC_K_SE,
                       f"K = {SIMHASH_BITS} bits, angles {', '.join(map(str, SIMHASH_ANGLES))} rad; agreements "
                       f"{', '.join(map(str, counts))} of {tables} tables against "
                       f"{', '.join(f'{tables * p:.1f}' for p in closed)} expected; exact binomial test",
                       tested=len(closed))


def magicpig_wrong_exponent_detected(rng: np.random.Generator, quick: bool, data: Any = None) -> CheckResult:
    """Negative control: the same Monte Carlo rejects ``(1 - theta/pi)^(K+1)`` (passes when detected)."""
    result = magicpig_collision_probability(rng, quick, exponent_offset=1)
    return CheckResult("decode.magicpig-wrong-exponent-detected", result.measured, MC_K_SE,
                       result.measured >= MC_K_SE, f"exponent K + 1 against the hash; {result.details}",
                       comparison=">=", tested=result.tested)


#: one decode query over M keys: key 0 is the sink and key M - 1 the local window (exact), the ten between are
#: hashed at these angles to the query, so that u = P[Bin(L, p^K) >= c] runs from 0.95 down to 0.05
INCLUSION_ANGLES = (1.0, 1.2, 1.4, 1.6, 1.75, 1.9, 2.05, 2.2, 2.35, 2.45)
INCLUSION_PARAMS = {"hash_bits": 2, "min_collisions": 2, "sinks": 1, "local": 1, "center": "none"}
INCLUSION_TABLES, INCLUSION_REPLICATES = 8, 20_000
#: the package's weights are -log u from the same formula: equal to a few roundings
INCLUSION_RTOL = 1e-10


def _inclusion_case(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``(x (1, D), y (M, D))``: a random query direction and the keys at :data:`INCLUSION_ANGLES` to it, each in a
    random plane through the query and of random norm (the sample must depend on the angle alone)."""
    x = rng.standard_normal((1, D))
    unit = x[0] / np.linalg.norm(x[0])
    y = rng.standard_normal((len(INCLUSION_ANGLES) + 2, D))  # rows 0 and M - 1 (sink, local) stay random
    for i, theta in enumerate(INCLUSION_ANGLES, start=1):
        other = rng.standard_normal(D)
        other -= (other @ unit) * unit
        y[i] = rng.uniform(0.5, 2.0) * (np.cos(theta) * unit + np.sin(theta) * other / np.linalg.norm(other))
    return x, y


def magicpig_inclusion_probability(rng: np.random.Generator, quick: bool, data: Any = None, *,
                                   select: Callable | None = None) -> CheckResult:
    r"""MagicPIG's sampler includes each hashed key with probability :math:`u` and weighs it by :math:`-\log u`
    (sec. 4.3 eq. 9-10, the binomial tail for c tables):

    .. math::
        u = P[\mathrm{Bin}(L, P) \ge c] = \sum_{j=c}^{L} \binom{L}{j} P^j (1 - P)^{L-j}, \qquad
        P = (1 - \theta / \pi)^K, \qquad \theta = \arccos\frac{x^\top y}{|x|\,|y|}.

    ``select`` (default: the package's ``reference.select``, on hyperplanes from ``magicpig.draw``; ``center="none"`` so
    that theta is the raw query-key angle) is compared with u from ``scipy.stats.binom.sf(c - 1, L, P)``, written
    out here. Closed form: every sampled key's ``log_weights`` equals :math:`-\log u` to 1e-10 (relative), the
    sink and local key weigh 1 (log 0) and an unsampled key is left out (-inf). Monte Carlo: the number of
    replicates in which each hashed key is ``sampled`` is Bin(R, u), tested exactly (z is the normal quantile of
    the two-sided binomial p-value, as in :func:`magicpig_collision_probability`). Passes when both hold.
    """
    from scipy.stats import binom, binomtest, norm

    from randattn.estimators.magicpig import draw, reference

    select = reference.select if select is None else select

    name = "decode.magicpig-inclusion-probability"
    k, tables, c = INCLUSION_PARAMS["hash_bits"], INCLUSION_TABLES, INCLUSION_PARAMS["min_collisions"]
    x, y = _inclusion_case(rng)
    replicates = INCLUSION_REPLICATES // (4 if quick else 1)
    hyperplanes = draw(x.shape, y.shape, num_samples=tables, replicates=replicates, rng=rng,
                       **INCLUSION_PARAMS)["hyperplanes"]  # (R, L, K, D)
    chosen = select(x, y, hyperplanes, **{key: v for key, v in INCLUSION_PARAMS.items() if key != "hash_bits"})
    hashed = slice(1, len(INCLUSION_ANGLES) + 1)
    cosine = (y[hashed] @ x[0]) / (np.linalg.norm(y[hashed], axis=-1) * np.linalg.norm(x[0]))
    theta = np.arccos(np.clip(cosine, -1.0, 1.0))
    u = binom.sf(c - 1, tables, (1.0 - theta / np.pi) ** k)  # P[Bin(L, P) >= c]
    # closed form: the weight of every sampled key against -log u, and the exact and left-out keys' weights
    log_weights, sampled = np.asarray(chosen.log_weights)[:, 0], np.asarray(chosen.sampled)[:, 0]  # (R, M)
    structure_ok = (np.all(log_weights[:, [0, -1]] == 0.0) and not sampled[:, [0, -1]].any()
                    and np.all(np.isneginf(log_weights[:, hashed][~sampled[:, hashed]])))
    expected = np.broadcast_to(-np.log(u), sampled[:, hashed].shape)[sampled[:, hashed]]
    with np.errstate(invalid="ignore"):
        gaps = np.abs(log_weights[:, hashed][sampled[:, hashed]] - expected) / np.abs(expected)
    worst = float(np.nan_to_num(gaps, nan=np.inf).max(initial=0.0)) if structure_ok else float("inf")
    # Monte Carlo: the inclusion counts are binomial, tested exactly (at u = 0.054 a quick run expects 270)
    counts = sampled[:, hashed].sum(0).astype(int)
    p_values = np.array([binomtest(int(n), replicates, float(p)).pvalue for n, p in zip(counts, u)])
    z = np.sign(counts / replicates - u) * norm.isf(p_values / 2.0)
    mc_worst = float(np.abs(z).max())
    mc = CheckResult(name, mc_worst, MC_K_SE, mc_worst <= MC_K_SE,
                     f"sampled {', '.join(map(str, counts))} of R = {replicates} against "
                     f"{', '.join(f'{replicates * p:.0f}' for p in u)} expected; exact binomial test",
                     tested=len(u))
    others = "exact keys 0 and unsampled -inf" if structure_ok else "WRONG weights of exact or unsampled keys"
    return closed_form_and_mc(name, worst, INCLUSION_RTOL, mc,
                               f"K = {k}, L = {tables}, c = {c}, angles {', '.join(map(str, INCLUSION_ANGLES))} rad "
                               f"(u {u.min():.3f}..{u.max():.3f}); {expected.size} sampled weights vs -log u, "
                               f"{others}; max relative gap")


# ---------------------------------------------------------------------------------------------- vAttention
#: a decode case: N queries over M keys, one sink, two local keys, two top-k keys, three residual draws
VATTENTION_SHAPE = (2, 12)
VATTENTION_PARAMS = {"budget": "fixed", "sinks": 1, "local": 2, "top_k": 2}
VATTENTION_DRAWS, VATTENTION_REPLICATES = 3, 4000


def _vattention_residual_sums(rng: np.random.Generator, quick: bool, reweight: float | np.ndarray = 1.0):
    """``(estimated (R, J), exact (J,))``: each query's residual denominator and numerators, formed here from the
    package's sampling weights (shifted by the query's largest visible logit, a constant factor)."""
    import torch

    from randattn.estimators.registry import get_spec
    from randattn.estimators.vattention import batched

    n, m = VATTENTION_SHAPE
    q, k, v = 0.7 * rng.standard_normal((n, D)), 0.7 * rng.standard_normal((m, D)), rng.standard_normal((m, DV))
    params = get_spec("vattention").resolve_params(VATTENTION_PARAMS)
    replicates = VATTENTION_REPLICATES // (4 if quick else 1)
    draws = get_spec("vattention").draw(q.shape, k.shape, num_samples=VATTENTION_DRAWS, replicates=replicates,
                                        rng=rng, mask="causal", **params)
    chosen = batched.select(torch.as_tensor(q), torch.as_tensor(k), draws.to_torch(), mask="causal", **params)
    logits, heavy = chosen.logits.numpy(), chosen.heavy.numpy()
    residual = np.isfinite(logits) & ~heavy
    shifted = np.exp(logits - logits.max(-1, keepdims=True))
    weights = np.where(residual, np.exp(chosen.log_weights.numpy()) * reweight, 0.0) * shifted
    exact = np.where(residual, shifted, 0.0)
    stacked = lambda w: np.concatenate([w.sum(-1), (w @ v).reshape(*w.shape[:-2], -1)], axis=-1)  # noqa: E731
    return stacked(weights), stacked(exact), residual.sum(-1).astype(float)


def vattention_residual_unbiased(rng: np.random.Generator, quick: bool, data: Any = None) -> CheckResult:
    """vAttention's sampled residual sums (denominator and numerator) are unbiased: each of b uniform draws with
    replacement weighted n_s / b (the paper's estimator; the official code's merged duplicates are not)."""
    from randattn.theory._base import mc_unbiased_result

    estimated, exact, _ = _vattention_residual_sums(rng, quick)
    return mc_unbiased_result("decode.vattention-residual-unbiased", estimated, exact,
                              f"causal N x M = {VATTENTION_SHAPE[0]} x {VATTENTION_SHAPE[1]}, {VATTENTION_PARAMS}, "
                              f"b = {VATTENTION_DRAWS} draws")


def vattention_off_by_one_detected(rng: np.random.Generator, quick: bool, data: Any = None) -> CheckResult:
    """Negative control: weights (n_s - 1) / b, a reweighting off by one, are rejected (passes when detected)."""
    from randattn.theory._base import mc_unbiased_result

    _, _, sizes = _vattention_residual_sums(np.random.default_rng(0), quick)  # the residual sizes n_s per query
    factor = ((sizes - 1) / sizes)[:, None]
    estimated, exact, _ = _vattention_residual_sums(rng, quick, reweight=factor)
    result = mc_unbiased_result("decode.vattention-off-by-one-detected", estimated, exact, "weights (n_s - 1) / b")
    return CheckResult(result.name, result.measured, MC_K_SE, result.measured >= MC_K_SE, result.details,
                       comparison=">=", tested=result.tested)


# -------------------------------------------------------------------------------- vAttention's CLT budget
#: one decode query over M keys (D = 8), its logits N(0, 0.5^2): 4 sinks, 4 local and 4 top-k keys exact, the rest
#: (1,012 keys) sampled; epsilon = 0.01, delta = 0.2, so that b ~ 4,200 draws and the Berry-Esseen term is ~0.03
BUDGET_KEYS, BUDGET_DIM, BUDGET_LOGIT_SD = 1024, 8, 0.5
BUDGET_PARAMS = {"budget": "fixed", "sinks": 4, "local": 4, "top_k": 4}
BUDGET_EPSILON, BUDGET_DELTA = 0.01, 0.2
BUDGET_REPLICATES = 4000
#: Shevtsova (2011): sup_x |P(Z_b <= x) - Phi(x)| <= C rho / (sigma^3 sqrt(b)) for b iid terms, C = 0.4748
BERRY_ESSEEN_C = 0.4748


def _residual_of_one_query(logits: np.ndarray, params: dict[str, int]) -> np.ndarray:
    """The residual (keys sampled) of a decode query seeing every key: not among the first ``sinks``, the last
    ``local`` (its own position is the last key) or the ``top_k`` largest logits of the others."""
    m = len(logits)
    heavy = set(range(params["sinks"])) | set(range(m - params["local"], m))
    others = [j for j in range(m) if j not in heavy]
    heavy |= set(sorted(others, key=lambda j: (-logits[j], j))[: params["top_k"]])
    return np.array([j not in heavy for j in range(m)])


#: the package's rule computes the same float64 expression: equal to a few roundings
BUDGET_RULE_RTOL = 1e-12
#: base samples (draws with replacement from the residual) on which the package's adaptive rule sizes b, and the
#: epsilons: b set by the cap n_s (0.01), by the bound or the floor b0 (0.05, 0.2)
BUDGET_BASE_SIZES = (3, 30, 200)
BUDGET_RULE_EPSILONS = (0.01, 0.05, 0.2)


def _adaptive_rule_gap(rng: np.random.Generator, x: np.ndarray, exact_part: float, quantile: str,
                       sample_size: Any) -> tuple[float, str]:
    r"""The package's adaptive rule (``sample_size``) against its formula written out here, on base samples of the
    residual's values ``x`` (shifted :math:`e^{s}`): :math:`\hat\sigma` their standard deviation (ddof 1),
    :math:`\hat D` = ``exact_part`` + :math:`rac{n_s}{b_0}\sum` base, :math:`b^* = (z n_s \hat\sigma /
    (\epsilon \hat D))^2`, :math:`b = \min(\max(b_0, \lceil b^* 
ceil), n_s)`. ``(worst relative gap of b* or
    b, description)``."""
    from scipy.stats import norm

    n_s = x.size
    z = norm.isf(BUDGET_DELTA / 2 if quantile == "two-sided" else BUDGET_DELTA)
    worst, sizes = 0.0, []
    for epsilon in BUDGET_RULE_EPSILONS:
        for b0 in BUDGET_BASE_SIZES:
            keys = rng.integers(0, n_s, size=b0)
            base = x[keys]
            bound = (z * n_s * base.std(ddof=1) / (epsilon * (exact_part + n_s / b0 * base.sum()))) ** 2
            size = min(max(b0, int(np.ceil(bound))), n_s)
            got_size, got_bound = sample_size(base, keys, exact_part, n_s, epsilon=epsilon, delta=BUDGET_DELTA,
                                              quantile=quantile, duplicates="count", rounding="ceil")
            worst = max(worst, abs(got_bound - bound) / bound, abs(got_size - size) / size)
            sizes.append(str(got_size))
    return worst, (f"epsilon {', '.join(map(str, BUDGET_RULE_EPSILONS))} x b0 {', '.join(map(str, BUDGET_BASE_SIZES))}"
                   f": b = {', '.join(sizes)}")


def vattention_clt_budget(rng: np.random.Generator, quick: bool, data: Any = None, *,
                          quantile: str = "two-sided", budget_scale: float = 1.0,
                          sample_size: Any = None) -> CheckResult:
    r"""vAttention's budget theorem, for the denominator: with the residual's own mean and spread, b draws with

    .. math:: b = \left\lceil \left( \Phi^{-1}(1 - \delta/2)\, \frac{n_s \sigma}{\epsilon D} \right)^2 \right\rceil

    give :math:`P(|\hat D - D| > \epsilon D) \le \delta + 2 C \rho / (\sigma^3 \sqrt b)`, the Berry-Esseen bound
    on the central limit theorem the budget rests on (:math:`\rho = E|x - \mu|^3` over the residual,
    :math:`C = 0.4748`, Shevtsova 2011; :math:`\hat D - D = \frac{n_s}{b} \sum_i (x_{j_i} - \mu)` is a sum of b
    iid terms, and :math:`b \ge b^*` puts :math:`\epsilon D` at least z standard deviations out). The package's
    sampler and weights make :math:`\hat D` (its ``log_denominator``, fixed budget S = b); the residual, n_s,
    sigma, rho, D and b are written out here. The rate over R replicates is tested one-sided against the bound:
    :math:`z = (\hat p - \beta) / \sqrt{\beta (1 - \beta) / R} \le` MC_K_SE. ``quantile="one-sided"`` (the
    official code's :math:`\Phi^{-1}(1 - \delta)`) and ``budget_scale`` < 1 are the negative controls.

    The package's adaptive rule, which plugs a base sample's :math:`\hat\sigma` and :math:`\hat D` into the same
    bound (``vattention.reference.sample_size``, or ``sample_size`` given here), is held to that formula written
    out (:func:`_adaptive_rule_gap`) on base samples of 3, 30 and 200 draws at three epsilons (so that the cap, the
    bound and the floor each set b), to 1e-12 relative: the Monte Carlo
    part fixes b, so that the theorem is tested apart from the estimates the rule uses. Passes when both hold.
    """
    import torch
    from scipy.stats import norm

    from randattn.estimators.registry import get_spec
    from randattn.estimators.vattention import batched

    spec = get_spec("vattention")
    direction = rng.standard_normal(BUDGET_DIM)
    q = (BUDGET_LOGIT_SD * np.sqrt(BUDGET_DIM) / np.linalg.norm(direction)) * direction[None, :]  # (1, D)
    k = rng.standard_normal((BUDGET_KEYS, BUDGET_DIM))
    logits = (k @ q[0]) / np.sqrt(BUDGET_DIM)  # logit sd 0.5: scale D^-1/2, |q| = 0.5 sqrt(D)
    residual = _residual_of_one_query(logits, BUDGET_PARAMS)
    shift = logits.max()
    x = np.exp(logits[residual] - shift)  # the residual's e^{s}, shifted: every ratio below is scale-free
    n_s, mu, sigma = x.size, x.mean(), x.std()  # population moments (ddof = 0): the theorem's sigma
    rho = np.mean(np.abs(x - mu) ** 3)
    denominator = np.exp(logits - shift).sum()
    tail = BUDGET_DELTA / 2 if quantile == "two-sided" else BUDGET_DELTA
    z = norm.isf(tail)
    draws_b = int(np.ceil(budget_scale * (z * n_s * sigma / (BUDGET_EPSILON * denominator)) ** 2))
    from randattn.estimators.vattention import reference

    rule_gap, rule_said = _adaptive_rule_gap(rng, x, (denominator - x.sum()), quantile,
                                             reference.sample_size if sample_size is None else sample_size)
    replicates = BUDGET_REPLICATES // (4 if quick else 1)
    params = spec.resolve_params(BUDGET_PARAMS)
    draws = spec.draw(q.shape, k.shape, num_samples=draws_b, replicates=replicates, rng=rng, mask="causal", **params)
    with torch.no_grad():
        log_estimate = batched.log_denominator(torch.as_tensor(q), torch.as_tensor(k), draws.to_torch(),
                                               mask="causal", **params).numpy()[:, 0]  # (R,)
    log_exact = np.log(denominator) + shift
    rate = float(np.mean(np.abs(np.expm1(log_estimate - log_exact)) > BUDGET_EPSILON))
    berry_esseen = 2 * BERRY_ESSEEN_C * rho / (sigma**3 * np.sqrt(draws_b))
    bound = BUDGET_DELTA + berry_esseen
    se = np.sqrt(bound * (1 - bound) / replicates)
    measured = (rate - bound) / se
    details = (f"one decode query over {BUDGET_KEYS} keys, logits N(0, {BUDGET_LOGIT_SD}^2), {BUDGET_PARAMS}: "
               f"n_s = {n_s}, b = {draws_b} draws ({quantile} quantile{'' if budget_scale == 1 else f' x {budget_scale:g}'}),"
               f" epsilon = {BUDGET_EPSILON}, delta = {BUDGET_DELTA}; P(|D_hat - D| > epsilon D) = {rate:.4f} over "
               f"R = {replicates}, bound delta + Berry-Esseen = {BUDGET_DELTA} + {berry_esseen:.4f} "
               f"(rho / sigma^3 = {rho / sigma**3:.3f}); a rate >= {bound + (MC_K_SE + 1.28) * se:.3f} would be "
               "caught with 90% power")
    mc = CheckResult("decode.vattention-clt-budget", float(measured), MC_K_SE, bool(measured <= MC_K_SE), details)
    return closed_form_and_mc("decode.vattention-clt-budget", rule_gap, BUDGET_RULE_RTOL, mc,
                              f"the package's adaptive rule against the bound written out ({rule_said}); max "
                              "relative gap")


def vattention_one_sided_quantile_detected(rng: np.random.Generator, quick: bool, data: Any = None) -> CheckResult:
    """Negative control: the official code's one-sided quantile, Phi^-1(1 - delta), sizes b for a two-sided level of
    2 delta; its rate is rejected against delta + the Berry-Esseen term (passes when detected)."""
    result = vattention_clt_budget(rng, quick, quantile="one-sided")
    return CheckResult("decode.vattention-one-sided-quantile-detected", result.measured, MC_K_SE,
                       result.measured >= MC_K_SE, result.details, comparison=">=")
