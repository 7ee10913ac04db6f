"""Name -> estimator spec: every estimator with its parameters, defaults, complexity and randomness.

Estimators register by being listed in ``_MODULES``; each module exposes ``SPEC``
(an :class:`~randattn.estimators.base.EstimatorSpec`).
"""

from __future__ import annotations

import importlib
from typing import Any

from randattn.estimators.base import EstimatorSpec
from randattn.estimators.names import display_name  # noqa: F401  (readable names live beside the registry)

__all__ = ["get_spec", "list_estimators", "catalogue", "parse_estimator"]

#: registry name -> module holding SPEC, in catalogue order
_MODULES: dict[str, str] = {
    "softmax": "randattn.estimators.softmax",
    "rfa": "randattn.estimators.rfa",
    "ra": "randattn.estimators.ra",
    "lara": "randattn.estimators.lara",
    "eva": "randattn.estimators.eva",
    "scatterbrain": "randattn.estimators.scatterbrain",
    "local": "randattn.estimators.local",
}


def _available() -> dict[str, str]:
    """Modules that exist in this installation (estimators under construction are skipped)."""
    found = {}
    for name, module in _MODULES.items():
        if importlib.util.find_spec(module) is not None:
            found[name] = module
    return found


def list_estimators() -> list[str]:
    """Registered estimator names, in catalogue order."""
    return list(_available())


def get_spec(name: str) -> EstimatorSpec:
    """The spec of estimator ``name``; ``ValueError`` listing the known names otherwise."""
    available = _available()
    if not isinstance(name, str) or name not in available:
        raise ValueError(f"unknown estimator {name!r}; known estimators: {', '.join(available)}")
    return importlib.import_module(available[name]).SPEC


def parse_estimator(text: str) -> tuple[str, dict[str, Any]]:
    """Parse ``"name"`` or ``"name:param=value,param=value"`` into a name and typed parameters.

    Values are converted by the parameter's declared default type (int, float, bool, str).
    """
    name, _, rest = text.partition(":")
    name = name.strip()
    spec = get_spec(name)
    params: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep:
            raise ValueError(f"estimator option {item!r} in {text!r} must look like param=value")
        if key == "preset":
            params[key] = raw.strip()
            continue
        if key not in spec.params:
            raise ValueError(
                f"unknown parameter {key!r} for estimator {name!r}; allowed: {', '.join([*sorted(spec.params), 'preset'])}"
            )
        params[key] = _convert(raw.strip(), spec.params[key].default)
    spec.resolve_params(params)
    return name, params


def _convert(raw: str, default: Any) -> Any:
    if isinstance(default, bool):
        if raw.lower() in ("true", "1", "yes"):
            return True
        if raw.lower() in ("false", "0", "no"):
            return False
        raise ValueError(f"expected true/false, got {raw!r}")
    if raw.lower() == "none":
        return None
    for kind in (int, float):
        if isinstance(default, kind) or default is None:
            try:
                return kind(raw)
            except ValueError:
                continue
    return raw


def catalogue() -> list[dict[str, Any]]:
    """One record per estimator: name, summary, parameters (default and choices), complexity, randomness,
    and presets (name -> the parameters it sets; ``paper`` = the defaults)."""
    records = []
    for name in list_estimators():
        spec = get_spec(name)
        defaults = spec.resolve_params({})
        records.append(
            {
                "name": name,
                "summary": spec.summary,
                "source": spec.source,
                "complexity": spec.complexity,
                "random": spec.is_random(defaults),
                "needs_samples": spec.needs_samples,
                "parameters": {
                    p: {"default": param.default, "choices": list(param.choices) if param.choices else None, "doc": param.doc}
                    for p, param in spec.params.items()
                },
                "presets": {preset: dict(spec.presets.get(preset, {})) for preset in spec.preset_names()},
            }
        )
    return records
