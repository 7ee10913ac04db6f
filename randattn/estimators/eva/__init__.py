"""EVA, efficient attention via control variates (Zheng et al., ICLR 2023, sec. 4, app. C).

Exact attention on a local block ``E^n`` (plus prefix/CLS keys) and, on C contiguous chunks
of the remaining keys, a control-variate estimate: a per-chunk coefficient ``beta_c`` (a
local SNIS from samples of ``N(mu_c, I)``) weighted by the chunk's attention mass (exact,
eq. 13; mean-pooled key, eq. 16; or its RFA estimate). ``num_samples`` is C. The draws are
data-independent standard normals ``eps : (R, ..., C, S_c, D)``; ``omega = mu_c + sigma eps``
is formed inside ``estimate`` for each query block (common random numbers across blocks).
The block/chunk layout and every choice the paper leaves open are documented in
:mod:`randattn.estimators.eva.partition`: with ``layout="grid"`` (default) and a ``grid="HxW"``
the local blocks are ``s x s`` windows of the patch grid (``window = s^2``, 49 = 7x7) and the
chunks are 2-D tiles (app. C "2D windows for images"); without a grid, 1-D contiguous blocks.
``mask="causal"`` (app. D, Algorithm 2) keeps the visible part of the block exact and chunks only
the keys before the block, so every chunk lies wholly before ``E^n`` (paper partition, 1-D
layouts; the convention is in :mod:`randattn.estimators.eva.partition`). A query whose block starts
at most C = ``num_samples`` keys in has at most one key a chunk, and with the ``exact`` (default) or
``mean-key`` chunk weight such a chunk's term is that key's exact term: its output is exact softmax
attention (the ``rfa`` chunk weight estimates even a one-key chunk's mass). With W = 49 and C = 64 on
512 causal tokens, the first two blocks (positions 0-97) are exact and the error starts at 98.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from randattn._validation import check_positive_int
from randattn.estimators import describe
from randattn.estimators.eva.partition import BLOCK_LAYOUT_VARIANTS, block_layout_facts
from randattn.estimators.base import Draws, family_spec, keyword_entry
from randattn.estimators.eva import batched, reference
from randattn.estimators.presets import EVA_PRESETS
from randattn.estimators.eva.partition import PARTITIONS, LayoutOptions
from randattn.estimators.eva.reference import CHUNK_WEIGHTS, NOISES, PROPOSAL_MEANS, SAMPLES, EvaOptions

#: the shared layout parameters of eva, scatterbrain and local, declared once as the fields of
#: :class:`~randattn.estimators.eva.partition.LayoutOptions`
LAYOUT_PARAMS = LayoutOptions.params()

#: EVA's parameters, declared once as the fields of :class:`~randattn.estimators.eva.reference.EvaOptions`
PARAMS = EvaOptions.params()


@keyword_entry(EvaOptions, leave_out=("scale",))
def draw(q_shape: Sequence[int], k_shape: Sequence[int], *, num_samples: int, replicates: int = 1,
         rng: np.random.Generator, options: EvaOptions) -> Draws:
    """``eps : (R, ..., C, S_c, D)`` standard normals with ``C = num_samples``.

    With ``sample="mean"`` nothing is random: ``eps`` is ``(R, ..., C, 0, D)``, which only
    carries the number of chunks. The draws do not depend on ``mask``: under ``"causal"`` each
    chunk group still has at most C chunks (of the keys before its block) and uses the first
    ones' ``eps`` as in the bidirectional form. A layout without a causal form (a grid, the
    code's partition) is refused by :class:`~randattn.estimators.eva.reference.EvaOptions`, before anything is drawn.
    """
    num_chunks = check_positive_int("num_samples", num_samples)
    per_chunk = options.samples_per_chunk if options.sample == "random" else 0
    shape = (replicates, *q_shape[:-2], num_chunks, per_chunk, q_shape[-1])
    eps = rng.standard_normal(shape) if per_chunk else np.zeros(shape)
    return Draws({"eps": eps}, replicates)


def _is_random(params) -> bool:
    return params.get("sample", "random") != "mean"


def _variants() -> dict[str, dict]:
    """Every option at least once, on a window of 4 so that 13 tokens make several blocks (the block layouts'
    ``window-4`` is the defaults' combination, so that one is not listed twice)."""
    variants: dict[str, dict] = dict(BLOCK_LAYOUT_VARIANTS)
    defaults = EvaOptions()
    for partition in PARTITIONS:
        for weight in CHUNK_WEIGHTS:
            for mean in PROPOSAL_MEANS:
                for sample in SAMPLES:
                    if (partition, weight, mean, sample) == (defaults.partition, defaults.chunk_weight,
                                                             defaults.proposal_mean, defaults.sample):
                        continue
                    variants[f"{partition}-{weight}-{mean}-{sample}"] = {
                        "window": 4, "partition": partition, "chunk_weight": weight, "proposal_mean": mean, "sample": sample,
                    }
    variants.update(
        {
            "mean-key-log-size": {"window": 4, "chunk_weight": "mean-key", "add_log_chunk_size": True},
            "noise-reference-code": {"window": 4, "noise": "reference-code"},
            "noise-reference-code-rfa": {"window": 4, "noise": "reference-code", "chunk_weight": "rfa"},
            "multi-sample-exact": {"window": 4, "samples_per_chunk": 3},
            "multi-sample-rfa-standard": {"window": 4, "samples_per_chunk": 3, "chunk_weight": "rfa", "proposal_mean": "standard"},
            "multi-sample-reference-code": {"window": 4, "samples_per_chunk": 2, "partition": "reference-code", "chunk_weight": "mean-key"},
            "cls-reference-code-mean-key": {"window": 4, "prefix_tokens": 1, "partition": "reference-code", "chunk_weight": "mean-key"},
            "cls-multi-sample-rfa": {"window": 4, "prefix_tokens": 1, "samples_per_chunk": 2, "chunk_weight": "rfa"},
            "no-window": {"window": 0},
            "no-window-cls": {"window": 0, "prefix_tokens": 1, "chunk_weight": "mean-key"},
            # layout="grid" (the default) with a grid: s x s windows and 2-D chunks; tokens = prefix + h*w
            "grid-3x5-reference-code-mean-key": {"window": 4, "grid": "3x5", "partition": "reference-code", "chunk_weight": "mean-key"},
            "grid-2x2-prefix5-rfa-multi-sample": {"window": 1, "prefix_tokens": 5, "grid": "2x2", "chunk_weight": "rfa", "samples_per_chunk": 2},
            "grid-no-window-cls": {"window": 0, "prefix_tokens": 1, "grid": "3x4", "chunk_weight": "mean-key", "sample": "mean"},
        }
    )
    return variants


def _cost(params: Mapping[str, Any]) -> str:
    """Linear only where no block re-chunks its complement and no chunk weight sums exact scores."""
    if params.get("partition") == "reference-code" and params.get("chunk_weight") != "exact":
        return "linear"
    return "quadratic"


SPEC = family_spec(
    EvaOptions, draw, reference, batched,
    name="eva",
    summary="EVA: exact local block + per-chunk control variates (beta_c from one sample of N(mu_c, I)) over C chunks",
    source="Zheng et al. ICLR 2023 (EVA) sec. 4 eq. 11-16, app. C eq. 26-28, Algorithm 1, app. G.1; causal: app. D, Algorithm 2",
    complexity=(
        "O(N W (D + Dv) + G M S_c D + N C S_c (D + Dv)), G = ceil(M / W) chunk groups for partition=paper "
        "(each block re-chunks its complement: O(M^2 / W)), G = 1 for reference-code (linear); "
        "chunk_weight=exact adds O(N M D); C = num_samples, S_c = samples_per_chunk; same in the grid layout; "
        "mask=causal: G = ceil(M / W) (each block chunks the keys before it), G = N for window=0"
    ),
    is_random=_is_random,
    variants=_variants(),
    presets=EVA_PRESETS,
    display_name="EVA",
    describe=describe.eva,
    convergence="none",
    cost=_cost,
    normalized=True,
    # the exact limit with the paper's disjoint partition only: the code's chunks hold the window's keys again
    **block_layout_facts("the local window holds every key and the partition is disjoint, so nothing is left to "
                         "the control variates (EVA sec. 4)", partition="paper"),
    memory_hint="N W local scores, C chunk summaries and S_c samples per chunk, per batch element",
)
