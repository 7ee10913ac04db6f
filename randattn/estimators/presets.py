"""Named parameter sets ("presets") that reproduce the official code's conventions in one word.

``lara:preset=official-code`` stands for the parameters below; explicitly given parameters
override a preset's (``lara:preset=official-code,beta=2``). ``preset="paper"`` (the default)
is the papers' estimator as written: every parameter at its default.

Source of every convention: the authors' code, HKUNLP/efficient-attention
(``efficient-attention/efficient_attention/{lara,eva,randomized_attention}.py``, commits
c3b361d / bfe2144), read for this module:

LARA (``LinearRA``, defaults ``proposal_gen="pool"``, ``mis_type="mis-opt"``, ``alpha_coeff=1.0``)
    - ``mu = q_bar + k_bar`` with pooled landmarks: proposal eq. 34 (``"pool-mixed"`` would be eq. 35).
    - ``weights = mu + torch.randn_like(mu)`` in the unscaled space, i.e. noise N(0, scale I) in the
      paper's variables: ``noise="reference-code"``.
    - ``alpha = balanced_heuristics + alpha_coeff (t_nc - mean_c t_nc)``: the decoupled weights of
      eq. 38 with ``beta = alpha_coeff = 1``; ``log(alpha.clamp(min=1e-8))``: ``alpha_clamp=1e-8``.
    - at inference (``not self.training``) ``weights = mu``: ``sample="mean"`` (``official-code-eval``).
EVA (``EVA``, default ``adaptive_proj="default"``)
    - ``mu = 0.5 (rf_q_bar + rf_k_bar)``: ``proposal_mean="half"``.
    - ``weights = mu + torch.randn_like(mu)`` unscaled: ``noise="reference-code"``.
    - the random-feature chunks ``rf_w_k`` tile *all* keys, the local window's included:
      ``partition="reference-code"``.
    - chunk logits ``q . scale * rf_k_bar`` with no chunk-size term: ``chunk_weight="mean-key"``,
      ``add_log_chunk_size=False``; one sample per chunk.
    - at inference ``weights = mu``: ``sample="mean"`` (``official-code-eval``).
RA (``RandomizedAttention``, default ``num_samples=1``)
    - a key index drawn from ``pi_n`` by ``torch.multinomial`` and ``mu = q + k'``: the unbiased
      variant; ``weights = mu + torch.randn_like(mu)`` unscaled: ``noise="reference-code"``.
    - its default of one sample per query is ``num_samples`` (``--samples 1``), not a parameter;
      its inference mode (``weights = q + k'`` with the index still random, no noise) has no
      counterpart here, so RA has no ``official-code-eval``.

The 2-D pooling of landmarks/chunks on image grids (``AdaptiveAvgPool2d``) and the learned
``Linear + LayerNorm`` maps on the landmarks (absent in pretrained softmax models) are not
parameters of these presets.
"""

from __future__ import annotations

from typing import Any, Mapping

__all__ = ["LARA_PRESETS", "EVA_PRESETS", "RA_PRESETS"]

_LARA_OFFICIAL: dict[str, Any] = {
    "proposal": "eq34",
    "weighting": "decoupled",
    "beta": 1.0,
    "alpha_clamp": 1e-8,
    "noise": "reference-code",
    "sample": "random",
}

LARA_PRESETS: Mapping[str, Mapping[str, Any]] = {
    "official-code": _LARA_OFFICIAL,
    "official-code-eval": {**_LARA_OFFICIAL, "sample": "mean"},
}

_EVA_OFFICIAL: dict[str, Any] = {
    "partition": "reference-code",
    "chunk_weight": "mean-key",
    "add_log_chunk_size": False,
    "proposal_mean": "half",
    "noise": "reference-code",
    "sample": "random",
    "samples_per_chunk": 1,
}

EVA_PRESETS: Mapping[str, Mapping[str, Any]] = {
    "official-code": _EVA_OFFICIAL,
    "official-code-eval": {**_EVA_OFFICIAL, "sample": "mean"},
}

RA_PRESETS: Mapping[str, Mapping[str, Any]] = {
    "official-code": {"variant": "unbiased", "noise": "reference-code", "sample": "random"},
}
