"""Readable names of estimator configurations, for legends, tables and reports.

A registry spec such as ``rfa:coupling=orthogonal`` is exact but means little to a reader who knows the papers;
:func:`display_name` turns a name and its parameters into the name the papers use, e.g.
``"Performer (FAVOR+, orthogonal)"`` or ``"LARA (paper, decoupled β=1)"``. Parameters left at their registry
default are not mentioned (except what defines the method, such as LARA's weighting); parameters this module does
not know (added by a newer registry) are appended as ``name=value`` so that distinct configurations keep distinct
names. The exact spec stays available beside the name (report tooltips and columns).
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable, Mapping

__all__ = ["display_name", "display_name_of_label", "parse_label"]

_FAMILY = {
    "softmax": "Softmax", "rfa": "Performer", "ra": "RA", "lara": "LARA", "eva": "EVA",
    "scatterbrain": "Scatterbrain", "local": "Local attention",
}  # fmt: skip
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


def _fmt(value: Any) -> str:
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


def _rfa(params, defaults) -> tuple[str, list[str], set[str]]:
    fmap = str(params.get("feature_map", "positive"))
    coupling = str(params.get("coupling", "iid"))
    return (f"{_FEATURE_MAPS.get(fmap, fmap)}, {_COUPLINGS.get(coupling, coupling)}", [],
            {"feature_map", "coupling"})


def _ra(params, defaults):
    return str(params.get("variant", "unbiased")), _common(params, defaults), {"variant", "sample", "noise"}


def _lara(params, defaults):
    weighting = str(params.get("weighting", "decoupled"))
    beta = params.get("beta", 1.0)
    if weighting == "decoupled":
        head = f"decoupled β={_fmt(float(beta)) if isinstance(beta, (int, float)) else beta}"
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
        parts.append(f"clamp {_fmt(params['alpha_clamp'])}")
    if params.get("layout") == "grid" and params.get("grid") not in (None, "", "none"):
        parts.append("2-D landmarks")  # LARA app. G.4: landmarks by 2-D average pooling on the patch grid
    parts += _common(params, defaults)
    return head, parts, {"weighting", "beta", "proposal", "alpha_clamp", "sample", "noise", "layout", "grid",
                         "prefix_tokens"}


def _eva(params, defaults):
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


def _scatterbrain(params, defaults):
    window = _window(params)
    coupling = _COUPLINGS.get(str(params.get("coupling", "iid")), params.get("coupling"))
    head = f"exact local {window} + FAVOR+ {coupling}" if window else f"FAVOR+ {coupling}, no local block"
    parts = [p for p in (_prefix(params),) if p] + _common(params, defaults)
    return head, parts, {"window", "coupling", "prefix_tokens", "layout", "grid"}


def _local(params, defaults):
    window = _window(params)
    head = f"exact {window.removesuffix(' window')} window" if window else "no local window"
    parts = [p for p in (_prefix(params),) if p] + _common(params, defaults)
    return head, parts, {"window", "prefix_tokens", "layout", "grid"}


def _softmax(params, defaults):
    return "exact", [], set()


_DESCRIBE: dict[str, Callable[..., tuple[str, list[str], set[str]]]] = {
    "softmax": _softmax, "rfa": _rfa, "ra": _ra, "lara": _lara, "eva": _eva, "scatterbrain": _scatterbrain,
    "local": _local,
}  # fmt: skip


def _defaults(name: str) -> dict[str, Any]:
    try:
        from randattn.estimators.registry import get_spec

        return {key: param.default for key, param in get_spec(name).params.items()}
    except (ValueError, ImportError):
        return {}


def display_name(name: str, params: Mapping[str, Any] | None = None) -> str:
    """The readable name of estimator ``name`` with ``params`` (partial or fully resolved).

    Parameters
    ----------
    name : str
        Registry name (``"rfa"``, ``"lara"``, ...); an unknown name is kept as it is.
    params : mapping, optional
        Parameters; missing ones take the registry default, unknown ones are appended as ``key=value``.

    Returns
    -------
    str
        E.g. ``"Performer (FAVOR+, orthogonal)"``, ``"LARA (paper, decoupled β=1)"``, ``"LARA (balance
        heuristic)"``, ``"RA (unbiased)"``; a non-default ``preset`` is named first (``"(official code, ...)"``).

    Examples
    --------
    >>> display_name("rfa", {"coupling": "orthogonal"})
    'Performer (FAVOR+, orthogonal)'
    >>> display_name("lara", {"weighting": "balance"})
    'LARA (balance heuristic)'
    """
    defaults = _defaults(name)
    given = dict(params or {})
    resolved = {**defaults, **given}
    family = _FAMILY.get(name, name)
    parts: list[str] = []
    preset = resolved.get("preset")
    if preset is not None and preset != defaults.get("preset", "paper"):
        parts.append("official code" if preset == "official-code" else f"{preset} preset")
    known: set[str] = {"preset"}
    describe = _DESCRIBE.get(name)
    if describe is not None:
        try:
            head, extra, known_here = describe(resolved, defaults)
            parts += [head, *extra]
            known |= known_here
        except (TypeError, ValueError):  # an unexpected value type: fall back to key=value below
            pass
    # parameters this module does not describe: named when they differ from the default, so names stay distinct
    for key in sorted(resolved):
        if key in known:
            continue
        if key not in defaults or resolved[key] != defaults[key]:
            parts.append(f"{key}={_fmt(resolved[key])}")
    if parts and parts[0].startswith("official code") and len(parts) > 1 and parts[1].startswith("paper, "):
        parts[1] = parts[1][len("paper, "):]
    return f"{family} ({', '.join(parts)})" if parts else family


def parse_label(label: str) -> tuple[str, dict[str, Any]]:
    """Split a sweep label ``"name:p=v,p=v"`` into the name and parameters (values typed where they look typed).

    Unlike :func:`randattn.estimators.registry.parse_estimator` this accepts parameters the registry does not
    know (a table written by another version), so a report can always name its rows.
    """
    name, _, rest = str(label).partition(":")
    params: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, _, raw = item.partition("=")
        try:
            params[key.strip()] = json.loads(raw.strip())
        except ValueError:
            params[key.strip()] = {"none": None, "true": True, "false": False}.get(raw.strip().lower(), raw.strip())
    return name.strip(), params


def display_name_of_label(label: str, params_json: str | Mapping[str, Any] | None = None) -> str:
    """:func:`display_name` of a results-table row: from its ``params`` JSON when given, else from the label."""
    name, params = parse_label(label)
    preset = {"preset": params["preset"]} if "preset" in params else {}  # the resolved params no longer say it
    if isinstance(params_json, Mapping):
        params = dict(params_json)
    elif isinstance(params_json, str) and params_json.strip():
        try:
            value = json.loads(params_json)
            params = value if isinstance(value, dict) else params
        except ValueError:
            pass
    return display_name(name, {**params, **preset})
