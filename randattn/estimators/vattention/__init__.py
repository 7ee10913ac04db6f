r"""vAttention: verified sparse attention, a heavy set computed exactly plus a reweighted uniform sample of the rest.

Desai, Agrawal, Yang, Cuadron, Schroeder, Zaharia, Gonzalez, Stoica, "vAttention: Verified Sparse Attention",
ICLR 2026, arXiv 2510.05688; official code xAlg-ai/sparse-attention-hub (``SinkMasker``, ``LocalMasker``,
``OracleTopK``, ``AdaptiveSamplingMasker``). The paper's body could not be read here: its estimator and budget
theorem are taken as the authors restate them in their post (skylight-org/website, ``VAttentionEntry.tsx``), the
conventions of the practical algorithm from the official code, and every place where the two differ is a
parameter (below). Steps, formulas and the budget rule: :mod:`.reference`.

Per query :math:`n` (logits :math:`s_m = x_n^\top y_m`):

.. math::
    \hat y_n = \frac{\sum_{m \in I_f} e^{s_m} v_m + \frac{n_s}{b} \sum_{i=1}^{b} e^{s_{j_i}} v_{j_i}}
                    {\sum_{m \in I_f} e^{s_m} + \frac{n_s}{b} \sum_{i=1}^{b} e^{s_{j_i}}},

with :math:`I_f` = sinks :math:`\cup` local window :math:`\cup` top-k (exact), :math:`j_1..j_b` drawn uniformly with
replacement from the :math:`n_s` other visible keys, each draw counted: both residual sums are unbiased and the
output, their ratio, is consistent (bias and variance :math:`O(1/b)`).

**The budget S** (``num_samples``, the sweep's ``--samples`` axis):

- ``budget="fixed"``: S is the residual sample size :math:`b` (draws with replacement, so a query reads at most
  S distinct sampled keys); the heavy set is set by ``sinks``, ``local`` and ``top_k`` alone. ``keys_used`` =
  heavy set + distinct sampled keys.
- ``budget="adaptive"`` (the default, the paper's method): S plays no part, so the configuration takes none
  (``num_samples=None``; a value given is checked and ignored) and a sweep measures it once, not once per S;
  :math:`b = \min(\max(b_0, \lceil b^* \rceil), n_s)` from the CLT bound :math:`b^*` for (epsilon, delta)
  (:func:`.reference.sample_size`), at most the :math:`n_s` keys sampled from (the official code's cap), so
  ``draw`` makes V uniforms per query for the sample and :math:`B = \max(2, \text{size}(\text{base\_rate}, V))`
  for the base sample, V the most keys a query sees (M; W under a window of W keys).

With fewer visible keys than the heavy set asks for, the heavy set is every visible key and nothing is sampled
(exact attention); under ``mask="causal"`` every set is among the visible keys ``m <= n + M - N``, and under
``mask="sliding:W"`` among the last W of those. The sinks are the sequence's first keys (the official code's
``SinkMasker``): a query whose window has passed them has none, and its heavy set is its local window and top-k
(it reads no key the layer hides).

**Defaults** (:data:`PARAMS`): the authors' published configuration (their post's vAttention config: 128 sinks,
128 local, top-k 10% of the keys, base rate 5%, epsilon = delta = 0.05) with the paper's conventions. Sizes are
counts (int) or fractions of the query's visible keys (float; the paper writes them :math:`f_s n`, :math:`f_l n`,
:math:`f_t n`). The top-k is the exact ("oracle") top-k by logit, the paper's best case; the paper also pairs
vAttention with approximate top-k predictors (HashAttention, PQCache), not implemented here. Ties: the lower key
index first. The local window is the ``local`` keys ending at the query's own position ``n + M - N`` (the official
code's band; under the causal mask, its most recent visible keys).

**Paper and official code** (the preset ``official-code`` sets all four):

- ``quantile``: the paper's theorem uses :math:`\Phi^{-1}(1 - \delta/2)`; the code ``norm.ppf(1 - delta)``, one-sided,
  so its nominal delta is half the two-sided one.
- ``duplicates``: the paper sums over the b draws (``count``: weight :math:`c_m n_s / b` on a key drawn
  :math:`c_m` times, unbiased); the code writes the probability :math:`b / n_s` into a mask once per distinct
  key (``merge``: weight :math:`n_s / b` however often drawn), which biases both residual sums low by the factor
  :math:`E[\#\text{distinct}] / b < 1`.
- ``sample_from``: the paper samples the residual (visible keys outside the heavy set); the code samples the window
  between the sinks and the local window with the top-k keys in it, a draw on a top-k key adding nothing (the
  merge clamps its weight to 1), reweights by the window's size, and computes its base-sample statistics over the
  window too; with fewer than two keys in the window it returns exact attention.
- ``rounding``: :math:`\lceil b^* \rceil` (the smallest b the paper's bound allows) or the code's
  :math:`\lfloor b^* \rfloor`.

Left out of the code's conventions: its ``1e-6`` added to the mask probabilities before inverting them and its
``1e-8`` floors on the standard deviation and the tolerance (no epsilons here, ARCHITECTURE sec. 4).

**The promise** (:attr:`SPEC.promise`, adaptive budget only): ``(epsilon, delta)`` as the paper's practical rule
states it, which is a promise on the **denominator**: per query, :math:`P(|\hat D - D| > \epsilon D) \le \delta`,
to the accuracy of the central limit theorem with :math:`\sigma` and :math:`D` replaced by their base-sample
estimates, and only where the cap :math:`b \le n_s` does not bind. The paper's theorem for a sum holds for the
numerator too and the authors combine the two for a guarantee on the output, but the sample size of the
algorithm (the paper's "denominator-only relaxation", and the official code) comes from the denominator alone,
so no bound on the output's relative error :math:`\lVert \hat y_n - y_n \rVert / \lVert y_n \rVert` is implied.
The spec says so (``promise_on="denominator"``, with :math:`\log \hat D` as ``log_denominator``), and the sweep
measures the violation rate of :math:`|\hat D - D| / D` against the promise; the output's relative error stays in
the table's ``rel_err_*`` columns, where an ``--epsilon`` run of the fixed budget also reads its rate. With
``quantile="one-sided"`` the nominal two-sided level is :math:`2\delta`; with ``duplicates="merge"`` the
denominator is biased low and the promise does not hold even asymptotically.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from randattn._validation import check_positive_int
from randattn.estimators.base import Draws, ExactLimit, family_spec, keyword_entry
from randattn.estimators.masks import check_causal_shapes
from randattn.estimators.vattention import batched, reference
from randattn.estimators.vattention.rules import PARAMS, VattentionOptions, most_visible_keys, uniform_counts

__all__ = ["OFFICIAL_CODE", "PARAMS", "SPEC", "draw"]

#: the official code's conventions (xAlg-ai/sparse-attention-hub ``AdaptiveSamplingMasker``)
OFFICIAL_CODE = {"quantile": "one-sided", "duplicates": "merge", "sample_from": "window", "rounding": "floor"}


@keyword_entry(VattentionOptions, leave_out=("scale",))
def draw(q_shape: Sequence[int], k_shape: Sequence[int], *, num_samples: int | None, replicates: int = 1,
         rng: np.random.Generator, options: VattentionOptions) -> Draws:
    r"""Uniforms on [0, 1) for every draw a query may take, independent across replicates, batch elements and queries.

    - ``residual_uniforms : (R, ..., N, S)`` (``budget="fixed"``) or ``(R, ..., N, V)`` (``"adaptive"``: the
      largest sample the budget allows, :math:`b \le n_s \le V`, with V the most keys a query sees: M without a
      mask and under ``causal``, ``min(W, M)`` under ``sliding:W``); query n's draw i picks the
      :math:`\lfloor u_i n_s \rfloor`-th key of the set it samples from (ascending key order).
    - ``base_uniforms : (R, ..., N, B)`` (adaptive only): the base sample, ``B = max(2, size(base_rate, V))``
      (the largest base sample); query n uses the first :math:`b_0` of them.

    The draws do not depend on the data; ``mask`` is checked here, before any work, and sets V. So ``estimate``
    is a pure function of them. ``num_samples`` is S with ``budget="fixed"``; the adaptive budget takes None (a
    positive integer given is ignored).
    """
    if options.mask is not None:
        check_causal_shapes(q_shape[-2], k_shape[-2])
    if num_samples is not None or options.budget == "fixed":
        num_samples = check_positive_int("num_samples", num_samples)
    main, base = uniform_counts(most_visible_keys(q_shape[-2], k_shape[-2], options.mask), num_samples,
                                options.parameters)
    lead = (replicates, *q_shape[:-2], q_shape[-2])
    arrays = {"residual_uniforms": rng.random((*lead, main))}
    if base:
        arrays["base_uniforms"] = rng.random((*lead, base))
    return Draws(arrays, replicates)


def _fixed_budget(params: Mapping[str, Any]) -> bool:
    """S is the sample size of the fixed budget; the adaptive one sets its own (module docstring)."""
    return params["budget"] == "fixed"


def _convergence(params: Mapping[str, Any]) -> str:
    """Fixed budget, paper's conventions: a ratio of two unbiased sums, consistent (MSE ~ 1/S; the kit's check
    confirms it). Adaptive: "none", since S does not set the sample size ((epsilon, delta) does), so error does
    not fall with S. Merged duplicates: "none": the residual sums' mean is the truth times
    :math:`n_s (1 - (1 - 1/n_s)^S) / S`, which falls toward 0 as S grows, so the bias grows with S."""
    if params.get("budget") != "fixed" or params.get("duplicates") == "merge":
        return "none"
    return "consistent"


def _promise(params: Mapping[str, Any]) -> tuple[float, float] | None:
    """``(epsilon, delta)`` for the adaptive budget: the denominator's relative error (package docstring)."""
    if params.get("budget") != "adaptive":
        return None
    return float(params["epsilon"]), float(params["delta"])


_SMALL = {"sinks": 1, "local": 2, "top_k": 2}
_SMALL_ADAPTIVE = {**_SMALL, "epsilon": 0.2, "delta": 0.2, "base_rate": 0.25}

SPEC = family_spec(
    VattentionOptions, draw, reference, batched,
    name="vattention",
    summary="vAttention: sinks + local window + top-k exact, a uniform sample of the residual reweighted by "
            "n_residual / n_sampled; sample size from a CLT budget for (epsilon, delta) or fixed at S",
    source="Desai et al., vAttention: Verified Sparse Attention, ICLR 2026, arXiv 2510.05688 (estimator of N and D, "
           "the CLT budget theorem, the denominator-only budget); official code xAlg-ai/sparse-attention-hub "
           "AdaptiveSamplingMasker",
    complexity="O(N M (D + Dv)): every key is scored (exact top-k) and the weighted softmax is dense; values "
               "read per query: sinks + local + top-k + at most b sampled",
    variants={
        "default": {},
        "fixed-small": {"budget": "fixed", **_SMALL},
        "adaptive-small": dict(_SMALL_ADAPTIVE),
        "official-code-small": {**_SMALL_ADAPTIVE, **OFFICIAL_CODE},
    },
    presets={"official-code": dict(OFFICIAL_CODE)},
    display_name="vAttention",
    convergence=_convergence,
    cost="quadratic",
    masks=(None, "causal", "sliding"),
    needs_samples=_fixed_budget,
    selection="discrete",
    normalized=True,
    exact_limits=(
        ExactLimit("the sinks cover every visible key (sinks=1.0): the heavy set is all keys, nothing is sampled",
                   params={"sinks": 1.0}),
        ExactLimit("the top-k keeps every key outside sinks and window (top_k=1.0, fixed budget)",
                   params={"top_k": 1.0, "sinks": 0, "local": 0, "budget": "fixed"}),
    ),
    keys_used=batched.keys_used,
    promise=_promise,
    promise_on="denominator",
    log_denominator=batched.log_denominator,
    memory_hint="N x M logits and R x N x M weights and counts per batch element; adaptive draws hold M + B "
                "uniforms per query and replicate",
    query_placement="last-n-of-m",
)
