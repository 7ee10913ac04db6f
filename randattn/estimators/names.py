"""Readable names of estimator configurations, for legends, tables and reports.

A registry spec such as ``rfa:coupling=orthogonal`` is exact but means little to a reader who knows the papers;
:func:`display_name` turns a name and its parameters into the name the papers use, from what the estimator's spec
declares (:attr:`~randattn.estimators.base.EstimatorSpec.display_name` and ``describe``), e.g.
``"Performer (FAVOR+, orthogonal)"`` or ``"LARA (paper, decoupled β=1)"``. Parameters left at their registry
default are not mentioned (except what defines the method, such as LARA's weighting); parameters the spec's
``describe`` does not cover are appended as ``name=value`` so that distinct configurations keep distinct
names. The exact spec stays available beside the name (report tooltips and columns).
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from randattn.estimators.describe import fmt as _fmt

__all__ = ["display_name", "display_name_of_label", "parse_label"]

def _spec(name: str) -> Any:
    """The registered spec of ``name``, or None (a table written with an estimator not installed here)."""
    from randattn.estimators.registry import get_spec

    try:
        return get_spec(name)
    except ValueError:
        return None


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
    spec = _spec(name)
    defaults = {} if spec is None else {key: param.default for key, param in spec.params.items()}
    given = dict(params or {})
    resolved = {**defaults, **given}
    family = name if spec is None else spec.family_name
    parts: list[str] = []
    preset = resolved.get("preset")
    if preset is not None and preset != defaults.get("preset", "paper"):
        parts.append("official code" if preset == "official-code" else f"{preset} preset")
    known: set[str] = {"preset"}
    describe = None if spec is None else spec.describe
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
