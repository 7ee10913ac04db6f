r"""MagicPIG: SimHash (K bits x L tables) as a sampler, self-normalized importance weights, sinks and local exact.

Chen et al., "MagicPIG: LSH Sampling for Efficient LLM Generation", arXiv 2410.16179 (v4; ICLR 2025), sec. 4.1-4.4,
eqs. 9-11, Algorithm 1, app. E; official code Infini-AI-Lab/MagicPIG (v0.2). For query n:

.. math::
    \hat o_n = \mathrm{softmax}_{m \in E_n \cup S_n}\bigl(x_n^\top y_m - \log u_{nm}\bigr)\, v,
    \qquad u_{nm} = P\bigl[\mathrm{Bin}(L, p_{nm}^K) \ge c\bigr], \qquad p_{nm} = 1 - \theta(x_n, y_m - \mu_n)/\pi,

with :math:`\log u = 0` on the exact keys :math:`E_n` and :math:`S_n` the candidates whose K-bit SimHash code
equals the query's in at least c of the L tables (:mod:`.reference` has every step).

Conventions (paper first; where the official code or sparse-attention-hub differs, it is an option):

- **Budget: S = num_samples = L, the number of hash tables**; K (``hash_bits``) is fixed. App. E.5: "K=8-10 is
  manually determined ... then we adjust L to obtain the wanted computation cost/budget"; app. E.3: the budget
  grows with L. S must be at least ``min_collisions`` (else no key could be sampled). The keys a query reads are
  random: ``sinks`` + ``local`` + the distinct sampled keys
  (``keys_used``; app. E.3 eq. 21 estimates the sampled fraction as :math:`u` at :math:`p^K = 0.5^K`).
- **Collision rule** ``min_collisions`` (c): 2 (default) is the paper's (sec. 4.3 "at least two hash tables",
  eq. 10, app. E.1) and the official code's (``library/lsh/lsh.cc``, ``retrieve``: a key is emitted on its
  second hit; ``sparse_attention.cc``, ``transform_kernel``: :math:`w = 1 - q^{L-1}(Lp + q)`). 1 is
  sparse-attention-hub's masker (``MagicPig``: any table; :math:`u = 1 - (1 - p^K)^L`). Any c <= L is allowed:
  :math:`u` is the binomial tail in log space.
- **Sinks and local window**: ``sinks=4`` first keys and ``local=64`` most recent keys are exact (weight 1) and
  never sampled (paper sec. 5.1 "the initial 4 tokens and local 64 (for LongBench and RULER) or 24 (for
  lm-eval-harness) tokens"; sec. 4.4 "on-device cache"; official code ``num_sink_tokens=4``,
  ``num_local_tokens=64``). "Most recent" = the ``local`` keys ending at the last key the query sees,
  :math:`t_n = n + M - N` under a causal or sliding mask and :math:`M - 1` without one. Under a mask every
  selection is among the visible keys; when sinks + local cover the keys a query sees, it is exact softmax.
  Under ``mask="sliding:W"`` the sinks stay the sequence's first tokens: a query whose window has passed them
  keeps its local keys exactly and samples the rest of its window (it reads no key the layer hides), so a window
  needs ``local >= 1``.
- **Centring** (``center``): the keys are centred before hashing, :math:`\bar k = k - \mu` (sec. 4.3 "data
  pre-processing"; sec. 5.3: without it accuracy collapses). ``"all-keys"`` (default): :math:`\mu_n` = the mean
  of every key query n sees (the paper's :math:`\frac1n\sum_i k_i` over the context; per query under the
  causal mask, so no hidden key moves it). ``"hashed-keys"``: the mean of the hashed keys only, those between
  the sinks and the local window (official code, ``attnserver.py`` ``fill``: ``offload_key.mean``).
  ``"none"``: no centring. The angle in :math:`p` is the one between the query and the *centred* key (the
  vectors hashed), as in Algorithm 1 and the official code. Queries are not centred (paper; official code
  normalises the query, which does not change its code); sparse-attention-hub also subtracts the key mean from
  the queries and appends the MIPS coordinate of eq. 8, which the paper says it does not use (sec. 5.1 "We do
  not use the theoretical transformations in Equation (8)"): neither is reproduced here. Softmax is invariant
  to translating the keys, so the logits use the keys as given. In a channel where every key averaged holds the
  same value, the mean is that value exactly (a rounded sum over the count may miss it by an ulp): a key among
  identical keys centres to exactly 0, so it has the all-zero code and the angle pi/2 with every non-zero query,
  in both forms. Limit: a key that is within rounding of the mean without being equal to every other key averaged
  in a channel (a near-copy; or the exact mean of different keys, such as the middle of three evenly spaced keys
  whose mean rounds) centres to rounding noise, which numpy and torch sum in different orders; its code and angle
  are then the noise's, and the forms may sample and weigh it differently. Keys drawn at random come so near
  with a probability of the order of float64 rounding, so the forms' float64 agreement (1e-10, the conformance
  kit's) holds for them; it is not claimed for inputs built with such keys.
- **No epsilon**: the official code adds 1e-4 to :math:`u` (``logf(w + 1e-4)``); here :math:`-\log u` is exact
  (log-space tail), so the weights are the inverse inclusion probabilities of eq. 9.
- **Hyperplanes**: :math:`K \times L` independent N(0, I_D) directions per replicate and batch element (the
  official code shares one set across heads and layers); a bit is :math:`[w^\top v > 0]`.
- **Angle**: :math:`\theta = 2\,\mathrm{atan2}(|\hat a - \hat b|, |\hat a + \hat b|)`, equal to eq. 10's
  arccos but accurate near 0 and pi.

Presets: ``"official-code"`` centres on the hashed keys; ``"sparse-attention-hub"`` samples on one collision.

Cost: O((N + M) L K D) projections and O(N M (D + Dv)) attention over the dense weights (``cost="quadratic"``),
plus the sampler. On the CPU it reads hash buckets as the paper's tables do: per group of 64 queries O(M L K)
comparisons and a sort of each table's M codes, plus the matches and the few (table, key) pairs whose bit differs
between the group's queries. On an accelerator it compares every (query, key, table, bit), O(N M L K), and reads
nothing back. Both take the same sample (:mod:`.batched`).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from randattn._validation import check_positive_int
from randattn.estimators.base import Draws, ExactLimit, family_spec, keyword_entry
from randattn.estimators.magicpig import batched, reference
from randattn.estimators.magicpig.reference import MagicpigOptions
from randattn.estimators.masks import check_causal_shapes

__all__ = ["PARAMS", "SPEC", "draw"]

#: MagicPIG's parameters, declared once as the fields of :class:`~.reference.MagicpigOptions`
PARAMS = MagicpigOptions.params()


@keyword_entry(MagicpigOptions, leave_out=("scale",))
def draw(q_shape: Sequence[int], k_shape: Sequence[int], *, num_samples: int, replicates: int = 1,
         rng: np.random.Generator, options: MagicpigOptions) -> Draws:
    """``hyperplanes : (R, ..., L, K, D)`` float64, iid N(0, 1): the K SimHash directions of each of the
    L = ``num_samples`` tables, independent across replicates and batch elements.

    Every parameter is checked here, before any work (ValueError naming it and its range); ``mask`` does not
    change the draws.
    """
    num_samples = options.check_tables(num_samples)
    replicates = check_positive_int("replicates", replicates)
    if options.mask is not None:
        check_causal_shapes(q_shape[-2], k_shape[-2])
    hyperplanes = rng.standard_normal((replicates, *q_shape[:-2], num_samples, options.hash_bits, q_shape[-1]))
    return Draws({"hyperplanes": hyperplanes}, replicates)


def _describe(params: Mapping[str, Any], defaults: Mapping[str, Any]) -> tuple[str, list[str], set[str]]:
    """``"MagicPIG (K=10, >= 2 tables, 4 sinks + 64 local)"`` plus the centring when not the paper's."""
    head = f"K={params['hash_bits']}, >= {params['min_collisions']} tables"
    parts = [f"{params['sinks']} sinks + {params['local']} local"]
    if params["center"] != defaults["center"]:
        parts.append({"hashed-keys": "centred on hashed keys", "none": "uncentred"}.get(params["center"],
                                                                                    f"center={params['center']}"))
    return head, parts, {"hash_bits", "min_collisions", "sinks", "local", "center"}


def _masks(params: Mapping[str, Any]) -> tuple[str | None, ...]:
    """A sliding window where the local keys keep every query's estimate non-empty (``local >= 1``)."""
    return (None, "causal", "sliding") if params.get("local", 1) >= 1 else (None, "causal")


SPEC = family_spec(
    MagicpigOptions, draw, reference, batched,
    name="magicpig",
    mask_notes={"sliding": "with local=0 a query whose window has passed the sinks keeps no exact key (it may "
                           "sample none); use local >= 1"},
    summary="MagicPIG: SimHash (K bits x L tables) samples keys, weighted by 1/P[collide in >= 2 tables], "
            "sinks + local window exact",
    source="Chen et al. 2024 (MagicPIG), arXiv 2410.16179 sec. 4.1-4.4, eqs. 9-11, Algorithm 1, app. E; "
           "code Infini-AI-Lab/MagicPIG",
    complexity="O((N + M) L K D + N M (D + Dv)) + the sampler: O(ceil(N / 64) L M (K + log M)) and the matches from "
               "hash buckets on the CPU, O(N M L K) comparisons on an accelerator; S = L tables",
    variants={
        # the defaults keep 68 exact keys, i.e. every key of the kit's small inputs: these variants sample
        "sampling": {"hash_bits": 2, "sinks": 1, "local": 2},
        "one-collision-uncentred": {"hash_bits": 3, "min_collisions": 1, "sinks": 0, "local": 1, "center": "none"},
        "official-code": {"hash_bits": 2, "sinks": 2, "local": 3, "center": "hashed-keys"},
    },
    presets={
        "official-code": {"center": "hashed-keys"},
        "sparse-attention-hub": {"min_collisions": 1},
    },
    display_name="MagicPIG",
    describe=_describe,
    # SNIS over a growing sample is consistent as L -> infinity (u -> 1 for every key with theta < pi), but not at
    # the kit's 1/S rate in S = L: while L p^K << 1 almost no candidate is sampled (u ~ C(L, c) p^(K c)), so at the
    # paper's K = 10 the error barely moves from L = 4 to 64, and afterwards it falls geometrically. No claim.
    convergence="none",
    cost="quadratic",
    selection="discrete",
    normalized=True,
    masks=_masks,
    exact_limits=(
        ExactLimit("the local window holds every key: every key exact, softmax attention (paper sec. 4.4)",
                   params=lambda n, m: {"sinks": 0, "local": m}),
        ExactLimit("the sinks hold every key: every key exact, softmax attention",
                   params=lambda n, m: {"sinks": m, "local": 0}),
    ),
    keys_used=batched.keys_used,
    memory_hint="an R x N x M sample and the N x M weights per batch element; on the CPU the key projections of "
                "32 tables at a time (M x 32 x K) and an N x M count of collisions; on an accelerator M x L x K key "
                "projections and, per chunk of queries, C x M x L hash agreements (C M L ~ 4M)",
)
