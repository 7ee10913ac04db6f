r"""The propositions of the papers, as documented checks: what ``randattn verify`` runs.

Each :class:`Check` has a name, the claim, its source (paper + equation), a method
(``exact identity`` to float64 rounding, ``closed form`` / numerical optimum, or
``Monte Carlo`` with tolerances from the standard error) and a function
``(rng, quick, data) -> CheckResult``. :func:`registry` lists them; :func:`run_checks` runs a
selection with one independent generator per check (derived from the run seed and the
check's name, so ``--only`` does not change a check's draws).

Monte Carlo policy (see :mod:`randattn.theory._base`): every comparison is a z-score
against the replicate standard error, threshold ``MC_K_SE = 4.5``; the registry's Monte Carlo
checks test at most ``MC_TEST_BUDGET = 1470`` elements in total, so a correct implementation
fails some Monte Carlo check with probability <= 1% (Bonferroni); a deviation of 5.8 SE is
caught with >= 90% power. Inputs are chosen where the estimators' higher moments are moderate.

Papers: LARA = ``papers/lara-randomized-attention-icml2022.md``, EVA =
``papers/eva-control-variates-iclr2023.md``, Performer = ``papers/performer-favor-plus-iclr2021.md``,
OPRF = Likhosherstov et al., "Chefs' Random Tables", NeurIPS 2022.

Examples
--------
>>> from randattn.theory import registry, run_checks, select_checks
>>> results = run_checks(select_checks(registry(), "lara.prop3.1*"), seed=0, quick=True)
>>> results[0].passed
True
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

from randattn.theory import _causal, _decode, _eva, _lara, _performer, _sderf, _stability
from randattn.theory._base import (
    EXACT_RTOL,
    MC_K_SE,
    MC_TEST_BUDGET,
    METHODS,
    Check,
    CheckResult,
    HeadData,
    VerifyData,
    check_rng,
    data_from_activations,
    select_checks,
)

__all__ = [
    "Check",
    "CheckResult",
    "HeadData",
    "VerifyData",
    "METHODS",
    "MC_K_SE",
    "MC_TEST_BUDGET",
    "EXACT_RTOL",
    "registry",
    "select_checks",
    "run_checks",
    "data_from_activations",
    "check_rng",
]

_EXACT, _CLOSED, _MC = METHODS

_SYNTH_MC = "synthetic (variance grows like exp(|x+y|^2): needs small norms)"


def registry() -> tuple[Check, ...]:
    """Every documented check, in table order (LARA, EVA, Performer, OPRF, SNIS, causal masks, numerics)."""
    return (
        # ---------------- LARA
        Check("lara.prop3.1.mixture", "N(w;0,I) sum_m xi(x,w) xi(y_m,w) / Z = sum_m pi_m N(w; x + y_m, I) pointwise",
              "LARA Prop. 3.1, app. A eq. 15-16", _EXACT, _lara.prop31_mixture, uses_data=True),
        Check("lara.lemmaA.1.component", "N(w;0,I) xi(x,w) xi(y,w) / exp(x.y) = N(w; x + y, I)",
              "LARA Lemma A.1", _EXACT, _lara.lemma_a1_component, uses_data=True),
        Check("lara.corC.1.hyperbolic", "hyperbolic features: target = 1/2 sum_m pi_m [N(x+y_m, I) + N(-x-y_m, I)]",
              "LARA app. C, Cor. C.1", _EXACT, _lara.corollary_c1_hyperbolic, uses_data=True),
        Check("lara.prop3.2.ra-unbiased", "E_{p_n}[f_n(w)] = softmax attention: RA is unbiased",
              "LARA Prop. 3.2, app. B, eq. 29-30", _MC, _lara.prop32_ra_unbiased, uses_data=True, max_tested=64),
        Check("lara.prop3.2.reference-code-noise-biased",
              "RA with the official code's noise N(0, scale I) is biased (passes when detected)",
              "LARA Prop. 3.2; docs: Architecture, The estimators", _MC, _lara.prop32_reference_code_biased, max_tested=15,
              synthetic_note=_SYNTH_MC),
        Check("lara.appF.mis-unbiased", "sum_c alpha_nc = 1 => eq. 8 MIS with exact p_n is unbiased (decoupled, balance)",
              "LARA eq. 8, app. F", _MC, _lara.appf_mis_unbiased, max_tested=36,
              synthetic_note="synthetic (p_n/q_c is heavy-tailed at ViT norms)"),
        Check("lara.eq27.weights-sum-to-one", "optimal (eq. 27), coupled, decoupled, balance weights sum to one",
              "LARA app. D eq. 27; app. G.3.2 eq. 36-38", _CLOSED, _lara.eq27_sums_to_one),
        Check("lara.eq10.consistent", "self-normalized MIS error falls with C: MSE(C=16) < MSE(C=2)",
              "LARA eq. 10 (sec. 4.2)", _MC, _lara.eq10_consistent, max_tested=1,
              synthetic_note="synthetic (one fixed input)"),
        Check("lara.sec4.3.rfa", "N(0,I) proposals + constant weights: LARA = RFA (same omega)",
              "LARA sec. 4.3, app. E eq. 28", _EXACT, _lara.sec43_lara_is_rfa, uses_data=True),
        Check("lara.sec4.3.ra", "no self-normalization, q_c = p_c, alpha = delta: MIS = RA (same omega)",
              "LARA sec. 4.3, eq. 8", _EXACT, _lara.sec43_lara_is_ra, uses_data=True),
        # ---------------- EVA
        Check("eva.eq6.snis-control-variate", "SNIS = g - (g/h)(h - E h), E h = 1; = RFA for q = N(0, I)",
              "EVA eq. 6, app. B.2", _EXACT, _eva.eq6_snis_is_control_variate,
              synthetic_note="synthetic (absolute weights p_n/q under/overflow at ViT norms)"),
        Check("eva.prop1.optimal-beta-exact", "beta_m* = v_m: sum_m g~_m = softmax attention (zero variance)",
              "EVA Prop. 1 eq. 8, app. B.4", _EXACT, _eva.prop1_optimal_beta_is_softmax, uses_data=True),
        Check("eva.B.3.per-key-mean", "E[h_m(w)] = exp(q.k_m) / Z for any proposal q",
              "EVA app. B.3 eq. 22", _MC, _eva.b3_per_key_mean, max_tested=10, synthetic_note=_SYNTH_MC),
        Check("eva.B.1.optimal-cv-coefficient", "beta* = Cov[h,g]/Var[h] minimizes Tr Var[g - beta h]",
              "EVA app. B.1 eq. 19-20", _CLOSED, _eva.b1_optimal_cv_coefficient),
        Check("eva.lemma3.partition", "weighted chunk means: J(beta_1..beta_C) <= J(shared beta), any alpha; "
              "the package's EVA coefficients estimate them",
              "EVA Lemma 3, app. B.5 eq. 24-25", _MC, _eva.lemma3_partition, max_tested=_eva.CHUNK_MC_TESTED,
              synthetic_note=_SYNTH_MC),
        Check("eva.prop2.eq10-minimizer", "eq. 10 beta_c* minimizes the attention-weighted MSE J (eq. 9); "
              "the package's EVA coefficients estimate it",
              "EVA Prop. 2, eq. 9-10, app. B.6", _MC, _eva.prop2_eq10_minimizer, uses_data=True,
              max_tested=_eva.CHUNK_MC_TESTED),
        Check("eva.G.1.rfa", "|E| = 0, C = 1: EVA = RFA (same omega)", "EVA app. G.1", _EXACT,
              _eva.g1_eva_is_rfa, uses_data=True),
        Check("eva.G.1.softmax-window", "|E| = M: EVA = softmax attention", "EVA app. G.1", _EXACT,
              _eva.g1_eva_full_window_is_softmax, uses_data=True),
        Check("eva.G.1.softmax-C=M", "C = M singleton chunks, exact weights: EVA = softmax attention",
              "EVA app. G.1", _EXACT, _eva.g1_eva_singleton_chunks_is_softmax, uses_data=True),
        Check("eva.G.5.scatterbrain", "Scatterbrain = EVA with C = 1, N(0,I) proposal, RFA chunk mass",
              "EVA app. G.5 eq. 29-30", _EXACT, _eva.g5_scatterbrain, uses_data=True),
        # ---------------- Performer
        Check("performer.lemma1.positive-unbiased", "E[xi(x,w) xi(y,w)] = exp(x.y), iid and orthogonal",
              "Performer Lemma 1 eq. 7; sec. 2.4", _MC, _performer.lemma1_positive, max_tested=12,
              synthetic_note=_SYNTH_MC),
        Check("performer.lemma1.hyperbolic-unbiased", "hyperbolic features are unbiased, iid and orthogonal",
              "Performer Lemma 1", _MC, _performer.lemma1_hyperbolic, max_tested=12, synthetic_note=_SYNTH_MC),
        Check("performer.orthogonal.plain-qr-biased", "orthogonal features without the QR sign fix are biased (passes when detected)",
              "Mezzadri 2007; docs: Architecture, The estimators", _MC, _performer.plain_qr_biased, max_tested=1,
              synthetic_note=_SYNTH_MC),
        Check("performer.lemma2.trigonometric-mse", "MSE_trig = (1/2m) e^{|z|^2} SM^-2 (1 - e^{-|x-y|^2})^2",
              "Performer Lemma 2 eq. 8", _MC, _performer.lemma2_trigonometric, max_tested=3, synthetic_note=_SYNTH_MC),
        Check("performer.lemma2.positive-mse", "MSE_+ = (1/m) e^{|z|^2} SM^2 (1 - e^{-|z|^2})",
              "Performer Lemma 2 eq. 8", _MC, _performer.lemma2_positive, max_tested=3, synthetic_note=_SYNTH_MC),
        Check("performer.lemma2.hyperbolic-mse", "MSE_hyp = (1/2)(1 - e^{-|z|^2}) MSE_+",
              "Performer Lemma 2 eq. 8, 20", _MC, _performer.lemma2_hyperbolic, max_tested=3, synthetic_note=_SYNTH_MC),
        Check("performer.thm1.smreg-closed-form", "Bessel closed form of SMREG = series eq. 29 = quadrature",
              "Performer Thm. 1 proof, eq. 21-29", _CLOSED, _performer.thm1_smreg_closed_form),
        Check("performer.thm1.smreg-bounds", "SMREG <= SM (d >= 2); lower bounds eq. 32, 33",
              "Performer Thm. 1 eq. 9, 31-33", _CLOSED, _performer.thm1_smreg_bounds),
        Check("performer.thm2.orthogonal-mse",
              "MSE_ort <= MSE_iid - (1 - 1/m) 2/(d+2) (SM - Lambda)^2 (m = d; corrected eq. 10)",
              "Performer Thm. 2 eq. 10, proof eq. 72-74 (corrected)", _MC, _performer.thm2_orthogonal_mse,
              max_tested=3, synthetic_note=_SYNTH_MC),
        Check("performer.thm2.printed-bound-infeasible",
              "eq. 10 as printed (gap (1-1/m) 2/(d+2) SM^2) is negative at small |z|: erratum (passes when found)",
              "Performer Thm. 2 eq. 10; Thm. 6 eq. 42, 74", _MC, _performer.thm2_printed_infeasible, max_tested=1,
              synthetic_note=_SYNTH_MC),
        # ---------------- OPRF
        Check("oprf.unbiased", "E[f(w,x) f(w,y)] = exp(x.y) for A < 1/4 (A* and A = -0.2)",
              "Likhosherstov et al. 2022 (OPRF)", _MC, _performer.oprf_unbiased, max_tested=12,
              synthetic_note=_SYNTH_MC),
        Check("oprf.variance-closed-form", "Var = (1-4A)^d (1-8A)^{-d/2} e^{2(1-4A)|z|^2/(1-8A) - |x|^2 - |y|^2} - e^{2x.y}",
              "OPRF (derived here)", _MC, _performer.oprf_variance_closed_form, max_tested=12,
              synthetic_note=_SYNTH_MC),
        Check("oprf.optimal-a", "A* minimizes the mean over pairs of the log second moment",
              "OPRF (closed-form A*)", _CLOSED, _performer.oprf_optimal_a_minimizes, uses_data=True),
        # ---------------- SDERF / FAVOR#
        Check("sderf.unbiased", "E[f(w,x) f(w,y)] = exp(x.y), f = det(I-4A)^1/4 exp(w'Aw + w'(I-4A)^1/2 x - |x|^2/2)",
              "Likhosherstov et al. 2023 (SDERF; derived in features.reference)", _MC, _sderf.sderf_unbiased,
              max_tested=12, synthetic_note=_SYNTH_MC),
        Check("sderf.variance-closed-form", "Var = det(I-4A) det(I-8A)^-1/2 e^{2z'(I-4A)(I-8A)^-1 z - |x|^2 - |y|^2} - e^{2x.y}",
              "SDERF (derived in features.reference)", _MC, _sderf.sderf_variance_closed_form, max_tested=12,
              synthetic_note=_SYNTH_MC),
        Check("sderf.scalar-a-reduction", "A = aI: SDERF = OPRF (features, variance); isotropic M: A* = OPRF's A* I",
              "SDERF vs OPRF (Likhosherstov et al. 2022)", _EXACT, _sderf.sderf_oprf_reduction, uses_data=True),
        Check("sderf.optimal-a", "A* = Q diag(lambda*(eig M)) Q' minimizes the mean log second moment over symmetric A",
              "SDERF (closed-form A*, derived in features.reference)", _CLOSED, _sderf.sderf_optimal_a_minimizes,
              uses_data=True),
        # ---------------- SNIS
        Check("snis.delta-method-variance", "delta-method variance = replicate variance for RFA at large S",
              "Owen 2013 sec. 9.2; LARA app. D eq. 19-20", _MC, _performer.snis_delta_method, max_tested=6,
              synthetic_note="synthetic (moderate weights, |x+y|^2 <= 1.6)"),
        # ---------------- causal masks
        Check("causal.prefix-invariance",
              "output n of every causal estimator is unchanged (bit-identical reference) when the keys and values "
              "after its last visible key n + M - N are replaced by junk",
              "Performer App. B.1; docs: Causal masks", _EXACT, _causal.prefix_invariance,
              synthetic_note="synthetic (junk of scale 30 after each query's past)"),
        Check("causal.mask-rule",
              "key m is visible to query n iff m <= n + M - N: the rule, the causal softmax estimator and the sweep's "
              "ground truth equal an explicit loop over the visible keys",
              "docs: Causal masks", _EXACT, _causal.mask_rule),
        Check("causal.last-query-bidirectional",
              "the last query of a causal self-attention sees every key: = the bidirectional output (same draws)",
              "docs: Causal masks", _EXACT, _causal.last_query_is_bidirectional),
        Check("causal.eva-full-window", "causal EVA whose local window covers the whole past = causal softmax",
              "EVA app. D, Alg. 2; app. G.1", _EXACT, _causal.eva_full_window_is_causal_softmax),
        # ---------------- decode-time sparse and sampling estimators
        Check("decode.budget-covers-every-key",
              "every estimator reporting keys_used equals causal softmax (an explicit loop) at a budget covering "
              "every visible key, decode (3 of 24 tokens) and self-attention, reference and batched, to 1e-12",
              "StreamingLLM sec. 3.2; Quest sec. 3.4, Alg. 1; MagicPIG sec. 4; vAttention (its residual estimator)",
              _EXACT, _decode.budget_covers_every_key),
        Check("decode.magicpig-collision-probability",
              "P(SimHash codes of query and key agree in a table) = (1 - theta/pi)^K (Monte Carlo of the hash)",
              "MagicPIG sec. 4.3 eq. 10; Charikar 2002", _MC, _decode.magicpig_collision_probability,
              max_tested=len(_decode.SIMHASH_ANGLES), synthetic_note="synthetic (chosen angles)"),
        Check("decode.magicpig-wrong-exponent-detected",
              "(1 - theta/pi)^(K+1) is rejected by the same Monte Carlo (passes when detected)",
              "MagicPIG sec. 4.3 eq. 10", _MC, _decode.magicpig_wrong_exponent_detected,
              max_tested=len(_decode.SIMHASH_ANGLES),
              synthetic_note="synthetic (chosen angles)"),
        Check("decode.magicpig-inclusion-probability",
              "the package's sampler includes a hashed key with u = P[Bin(L, (1 - theta/pi)^K) >= c] (Monte Carlo, "
              "exact binomial test) and weighs it by -log u (to 1e-10)",
              "MagicPIG sec. 4.3 eq. 9-10", _MC, _decode.magicpig_inclusion_probability,
              max_tested=len(_decode.INCLUSION_ANGLES),
              synthetic_note="synthetic (one decode query, chosen angles, uncentred)"),
        Check("decode.vattention-residual-unbiased",
              "E[n_s/b sum of b uniform residual draws] = the residual's numerator and denominator sums",
              "vAttention (the sampled residual; arXiv 2510.05688)", _MC, _decode.vattention_residual_unbiased,
              max_tested=8,
              synthetic_note="synthetic (decode, 2 queries over 12 keys)"),
        Check("decode.vattention-off-by-one-detected",
              "weights (n_s - 1)/b are rejected by the same z-test (passes when detected)",
              "vAttention (arXiv 2510.05688)", _MC, _decode.vattention_off_by_one_detected, max_tested=8,
              synthetic_note="synthetic (decode, 2 queries over 12 keys)"),
        Check("decode.vattention-clt-budget",
              "b = ceil((Phi^-1(1 - delta/2) n_s sigma / (epsilon D))^2) uniform residual draws give "
              "P(|D_hat - D| > epsilon D) <= delta + 2 C rho / (sigma^3 sqrt(b)) (Berry-Esseen, C = 0.4748); the "
              "adaptive rule computes that b from a base sample's sigma and D, within its floor and cap",
              "vAttention (the budget theorem, for the denominator; arXiv 2510.05688); Shevtsova 2011",
              _MC, _decode.vattention_clt_budget, max_tested=1,
              synthetic_note="synthetic (one decode query over 1,024 keys, logits of sd 0.5)"),
        Check("decode.vattention-one-sided-quantile-detected",
              "the official code's Phi^-1(1 - delta) sizes b for 2 delta: rejected by the same test (passes when "
              "detected)",
              "vAttention's official code (AdaptiveSamplingMasker)", _MC,
              _decode.vattention_one_sided_quantile_detected, max_tested=1,
              synthetic_note="synthetic (one decode query over 1,024 keys, logits of sd 0.5)"),
        # ---------------- numerics
        Check("numerics.large-norm-stability",
              "every registered estimator is finite at key norms >= 150, float32 and float64; batched = reference "
              "within its dtype's tolerance; softmax = verify's own exact softmax",
              "docs: Architecture, Numerics (ViT key norms above 100, no epsilon)", _EXACT, _stability.large_norm_stability,
              synthetic_note="synthetic (key norms 150..160)"),
    )


def run_checks(
    checks: Sequence[Check],
    *,
    seed: int = 0,
    quick: bool = False,
    data: VerifyData | None = None,
    on_result: Callable[[Check, CheckResult, float], None] | None = None,
) -> tuple[CheckResult, ...]:
    """Run ``checks`` in order; each gets :func:`check_rng` ``(seed, name)``.

    A check that raises counts as failed (measured NaN, the exception in ``details``): one broken
    check must not hide the others. ``on_result(check, result, seconds)`` is called after each
    (the CLI's progress bar).
    """
    results = []
    for check in checks:
        start = time.perf_counter()
        try:
            result = check.run(check_rng(seed, check.name), quick, data)
        except Exception as exc:  # noqa: BLE001 - reported as a failed check, with its type and message
            result = CheckResult(check.name, float("nan"), float("nan"), False, f"error: {type(exc).__name__}: {exc}")
        if check.method == "Monte Carlo" and check.max_tested and result.tested > check.max_tested:
            result = CheckResult(check.name, result.measured, result.tolerance, False,
                                 f"tested {result.tested} elements > declared {check.max_tested} (budget); " + result.details,
                                 result.comparison, result.tested)
        results.append(result)
        if on_result is not None:
            on_result(check, result, time.perf_counter() - start)
    return tuple(results)


def mc_tested_total(checks: Sequence[Check]) -> int:
    """Declared Monte Carlo elements of ``checks`` (must stay <= MC_TEST_BUDGET)."""
    return sum(c.max_tested for c in checks if c.method == "Monte Carlo")


def family_wise_false_alarm(checks: Sequence[Check]) -> float:
    """Bonferroni bound on P(some correct Monte Carlo check fails): ``total * 2 * sf(MC_K_SE)``."""
    from scipy.stats import norm

    return float(mc_tested_total(checks) * 2.0 * norm.sf(MC_K_SE))


__all__ += ["mc_tested_total", "family_wise_false_alarm"]
