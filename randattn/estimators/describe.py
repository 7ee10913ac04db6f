"""How the built-in estimators describe a configuration in words, for legends, tables and reports.

Each function is an :attr:`~randattn.estimators.base.EstimatorSpec.describe`:
``describe(params, defaults) -> (head, parts, known)`` where ``head`` and ``parts`` are the phrases
that go in parentheses after the family's display name (``"Performer (FAVOR+, orthogonal)"``) and
``known`` names the parameters the phrases cover; :func:`randattn.estimators.names.display_name`
appends any other non-default parameter as ``key=value`` so that distinct configurations keep
distinct names. Pure string formatting: no registry, no estimator imports.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

__all__ = ["softmax", "rfa", "ra", "lara", "eva", "scatterbrain", "local", "fmt"]

_FEATURE_MAPS = {
    "positive": "FAVOR+", "hyperbolic": "FAVOR+ hyperbolic", "trigonometric": "trigonometric RFA",
    "regularized": "FAVOR+ regularized", "oprf": "FAVOR++", "sderf": "FAVOR#",
}  # fmt: skip
_COUPLINGS = {"iid": "iid", "orthogonal": "orthogonal", "simplex": "simplex",
              "orthogonal-plain-qr": "orthogonal, plain QR (biased)"}
_LARA_WEIGHTINGS = {"balance": "balance heuristic", "coupled": "coupled weights", "constant": "constant 1/C"}
_LARA_PROPOSALS = {"eq33": "eq. 33 proposals", "eq35": "eq. 35 proposals", "eq32": "RA-mixture proposals (eq. 32)",
                   "standard": "standard-normal proposals"}
_EVA_CHUNK_WEIGHTS = {"mean-key": "mean-key chunk weights", "rfa": "random-feature chunk weights"}
_EVA_PROPOSAL_MEANS = {"half": "half proposal mean (code)", "standard": "standard-normal proposals"}


def fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return "×".join(map(str, value))
    return str(value)


def _window(params: Mapping[str, Any]) -> str | None:
    """``"7×7"`` for a square window on a patch grid, ``"49-token window"`` for a 1-D one, None for none."""
    window = params.get("window")
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return None
    side = math.isqrt(window)
    on_grid = params.get("layout") == "grid" and params.get("grid") not in (None, "", "none")
    return f"{side}×{side}" if on_grid and side * side == window else f"{window}-token window"


def _prefix(params: Mapping[str, Any]) -> str | None:
    prefix = params.get("prefix_tokens")
    if not prefix:
        return None
    return "CLS exact" if prefix == 1 else f"{prefix} prefix tokens exact"


def _common(params: Mapping[str, Any], defaults: Mapping[str, Any]) -> list[str]:
    """Phrases for options several estimators share (sampling, noise, layout), when not at their default."""
    parts = []
    if params.get("sample") == "mean":
        parts.append("mean sample")
    if params.get("noise") == "reference-code":
        parts.append("code noise")
    if "layout" in params and params.get("layout") != defaults.get("layout"):
        parts.append(f"{params['layout']} layout")
    return parts


def rfa(params, defaults) -> tuple[str, list[str], set[str]]:
    fmap = str(params.get("feature_map", "positive"))
    coupling = str(params.get("coupling", "iid"))
    return (f"{_FEATURE_MAPS.get(fmap, fmap)}, {_COUPLINGS.get(coupling, coupling)}", [],
            {"feature_map", "coupling"})


def ra(params, defaults):
    return str(params.get("variant", "unbiased")), _common(params, defaults), {"variant", "sample", "noise"}


def lara(params, defaults):
    weighting = str(params.get("weighting", "decoupled"))
    beta = params.get("beta", 1.0)
    if weighting == "decoupled":
        head = f"decoupled β={fmt(float(beta)) if isinstance(beta, (int, float)) else beta}"
        plain = all(params.get(k) == defaults.get(k) for k in defaults if k not in ("beta", "layout", "grid",
                                                                                   "prefix_tokens"))
        head = f"paper, {head}" if plain and beta == defaults.get("beta", 1.0) else head
    else:
        head = _LARA_WEIGHTINGS.get(weighting, weighting)
    parts = []
    proposal = params.get("proposal", "eq34")
    if proposal != "eq34":
        parts.append(_LARA_PROPOSALS.get(proposal, f"proposal {proposal}"))
    if params.get("alpha_clamp") is not None:
        parts.append(f"clamp {fmt(params['alpha_clamp'])}")
    if params.get("layout") == "grid" and params.get("grid") not in (None, "", "none"):
        parts.append("2-D landmarks")  # LARA app. G.4: landmarks by 2-D average pooling on the patch grid
    parts += _common(params, defaults)
    return head, parts, {"weighting", "beta", "proposal", "alpha_clamp", "sample", "noise", "layout", "grid",
                         "prefix_tokens"}


def eva(params, defaults):
    window = _window(params)
    head = f"exact local {window} + control variates" if window else "control variates, no local block"
    parts = []
    if params.get("partition") == "reference-code":
        parts.append("code partition")
    weight = params.get("chunk_weight", "exact")
    if weight != "exact":
        parts.append(_EVA_CHUNK_WEIGHTS.get(weight, f"chunk weight {weight}"))
    if params.get("add_log_chunk_size"):
        parts.append("+log chunk size")
    mean = params.get("proposal_mean", "sum")
    if mean != "sum":
        parts.append(_EVA_PROPOSAL_MEANS.get(mean, f"proposal mean {mean}"))
    per_chunk = params.get("samples_per_chunk", 1)
    if per_chunk != 1:
        parts.append(f"{per_chunk} samples/chunk")
    if _prefix(params):
        parts.append(_prefix(params))
    parts += _common(params, defaults)
    return head, parts, {"window", "partition", "chunk_weight", "add_log_chunk_size", "proposal_mean",
                         "samples_per_chunk", "prefix_tokens", "sample", "noise", "layout", "grid"}


def scatterbrain(params, defaults):
    window = _window(params)
    coupling = _COUPLINGS.get(str(params.get("coupling", "iid")), params.get("coupling"))
    head = f"exact local {window} + FAVOR+ {coupling}" if window else f"FAVOR+ {coupling}, no local block"
    parts = [p for p in (_prefix(params),) if p] + _common(params, defaults)
    return head, parts, {"window", "coupling", "prefix_tokens", "layout", "grid"}


def local(params, defaults):
    window = _window(params)
    head = f"exact {window.removesuffix(' window')} window" if window else "no local window"
    parts = [p for p in (_prefix(params),) if p] + _common(params, defaults)
    return head, parts, {"window", "prefix_tokens", "layout", "grid"}


def softmax(params, defaults):
    return "exact", [], set()




