"""Name -> estimator spec: the built-in estimators and every plugin, found the same way.

An estimator is an :class:`~randattn.estimators.base.EstimatorSpec` (ARCHITECTURE sec. 13). Specs
reach the registry by one of two public paths:

- **installed packages** declare an entry point in the group ``randattn.estimators`` whose name is
  the estimator's name and whose object is its spec (or a function of no arguments returning it)::

      [project.entry-points."randattn.estimators"]
      nystrom = "randattn_nystrom:SPEC"

  randattn's own estimators are declared this way in its ``pyproject.toml``;
- **a running session** calls :func:`register_estimator` (process-local; a sweep on Dask ships such
  specs to its workers).

Discovery is lazy: the first lookup loads every entry point of the group. A plugin that fails to
import, whose spec fails :func:`~randattn.estimators.base.validate_spec`, or that claims a built-in's name
is left out with a :class:`PluginError` that names it (:func:`plugin_errors`); a name that two installed
plugins claim is given to neither (which one won would depend on the order of discovery), with one error
that names both. The others work as usual, and asking for a name left out raises its error.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from randattn.estimators.base import EstimatorSpec, SpecError, UnknownParameterError, validate_spec

__all__ = [
    "ENTRY_POINT_GROUP",
    "EstimatorRegistry",
    "PluginError",
    "catalogue",
    "get_spec",
    "list_estimators",
    "parse_estimator",
    "plugin_errors",
    "register_estimator",
    "unregister_estimator",
    "spec_origin",
    "session_specs",
    "ensure_registered",
    "takes_no_samples",
]

ENTRY_POINT_GROUP = "randattn.estimators"

#: randattn's own entry points, in catalogue order. They are read from the installed package's metadata
#: like any plugin's; this list only orders them, and stands in for the metadata when randattn runs
#: from a source tree that was never installed (tests check that it matches ``pyproject.toml``).
BUILTIN_ENTRY_POINTS: tuple[tuple[str, str], ...] = (
    ("softmax", "randattn.estimators.softmax:SPEC"),
    ("rfa", "randattn.estimators.rfa:SPEC"),
    ("ra", "randattn.estimators.ra:SPEC"),
    ("lara", "randattn.estimators.lara:SPEC"),
    ("eva", "randattn.estimators.eva:SPEC"),
    ("scatterbrain", "randattn.estimators.scatterbrain:SPEC"),
    ("local", "randattn.estimators.local:SPEC"),
    ("topk", "randattn.estimators.topk:SPEC"),
    ("streaming", "randattn.estimators.streaming:SPEC"),
    ("quest", "randattn.estimators.quest:SPEC"),
    ("magicpig", "randattn.estimators.magicpig:SPEC"),
    ("vattention", "randattn.estimators.vattention:SPEC"),
)
_BUILTIN_DIST = "randattn"


@dataclass(frozen=True)
class PluginError:
    """Why a plugin's estimator is not registered.

    Attributes
    ----------
    name : str
        The entry point's name (the estimator name it claims).
    origin : str
        Where it came from: ``entry point 'nystrom = randattn_nystrom:SPEC' of package randattn-nystrom 0.1``.
    message : str
        What went wrong.
    """

    name: str
    origin: str
    message: str

    def __str__(self) -> str:
        return f"estimator plugin {self.name!r} ({self.origin}) could not be registered: {self.message}"


@dataclass(frozen=True)
class _EntryPoint:
    """What the registry needs of an entry point (``importlib.metadata.EntryPoint`` or a built-in stand-in)."""

    name: str
    value: str
    dist: str

    def load(self) -> Any:
        module, _, attr = self.value.partition(":")
        obj = importlib.import_module(module.strip())
        for part in filter(None, attr.strip().split(".")):
            obj = getattr(obj, part)
        return obj

    @property
    def origin(self) -> str:
        return f"entry point '{self.name} = {self.value}' of package {self.dist}"


def installed_entry_points() -> list[_EntryPoint]:
    """The group's entry points from the installed packages' metadata; randattn's own first, in catalogue order.

    When randattn itself is not installed (a source tree on ``sys.path``), its built-ins come from
    :data:`BUILTIN_ENTRY_POINTS`.
    """
    found = []
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(ep, "dist", None)
        label = f"{dist.name} {dist.version}" if dist is not None else "unknown"
        found.append(_EntryPoint(ep.name, ep.value, label))
    builtin_order = {name: i for i, (name, _) in enumerate(BUILTIN_ENTRY_POINTS)}
    ours = [ep for ep in found if ep.dist.split(" ")[0] == _BUILTIN_DIST]
    if not ours:
        ours = [_EntryPoint(name, value, f"{_BUILTIN_DIST} (source tree)") for name, value in BUILTIN_ENTRY_POINTS]
    others = sorted((ep for ep in found if ep.dist.split(" ")[0] != _BUILTIN_DIST), key=lambda ep: (ep.name, ep.dist))
    ours = sorted(ours, key=lambda ep: builtin_order.get(ep.name, len(builtin_order)))
    # an editable install and a wheel of randattn can both be on the path: one copy of each built-in
    seen: set[tuple[str, str]] = set()
    unique = []
    for ep in ours:
        if (ep.name, ep.value) not in seen:
            seen.add((ep.name, ep.value))
            unique.append(ep)
    return unique + others


class EstimatorRegistry:
    """Estimator specs by name, filled lazily from entry points and by :meth:`register`.

    One instance serves the process (:func:`get_spec` and friends); tests make their own with an
    ``entry_points`` function of their choosing.

    Parameters
    ----------
    entry_points : callable, optional
        ``() -> iterable`` of objects with ``name``, ``load()`` and ``origin``; default
        :func:`installed_entry_points`.
    """

    def __init__(self, entry_points: Callable[[], Iterable[Any]] | None = None) -> None:
        self._entry_points = installed_entry_points if entry_points is None else entry_points
        self._specs: dict[str, EstimatorSpec] = {}
        self._origins: dict[str, str] = {}
        self._errors: list[PluginError] = []
        self._discovered = False

    # ------------------------------------------------------------------------------------------------ discovery
    def discover(self) -> None:
        """Load every entry point once; failures become :class:`PluginError` records, never exceptions."""
        if self._discovered:
            return
        self._discovered = True
        contested: dict[str, list[str]] = {}  # a name two plugins claim -> their origins: neither is registered
        builtin: set[str] = set()  # names of randattn's own entry points: reserved
        for ep in self._entry_points():
            origin = getattr(ep, "origin", repr(ep))
            try:
                obj = ep.load()
                spec = obj() if callable(obj) and not isinstance(obj, EstimatorSpec) else obj
                validate_spec(spec)
            except SpecError as exc:
                self._errors.append(PluginError(ep.name, origin, str(exc)))
                continue
            except Exception as exc:  # a plugin may raise anything on import; it must not break the others
                self._errors.append(PluginError(ep.name, origin, f"{type(exc).__name__}: {exc}"))
                continue
            if spec.name != ep.name:
                self._errors.append(PluginError(
                    ep.name, origin, f"the entry point is named {ep.name!r} but its spec is named {spec.name!r}"))
                continue
            if spec.name in contested:
                contested[spec.name].append(origin)
                continue
            if spec.name in self._specs:
                if self._specs[spec.name] is spec:
                    continue
                if spec.name not in builtin:
                    # which of two plugins is used would depend on the order of discovery: neither is
                    contested[spec.name] = [self._origins.pop(spec.name), origin]
                    del self._specs[spec.name]
                    continue
                self._errors.append(PluginError(
                    ep.name, origin, f"the name {spec.name!r} is taken by {self._origins[spec.name]}"))
                continue
            self._specs[spec.name] = spec
            self._origins[spec.name] = origin
            if str(getattr(ep, "dist", "")).split(" ")[0] == _BUILTIN_DIST:
                builtin.add(spec.name)
        for name, origins in contested.items():
            claims = "; ".join(origins)
            self._errors.append(PluginError(
                name, origins[0], f"the name {name!r} is claimed by {len(origins)} installed plugins ({claims}), "
                "so none of them is used: uninstall all but one"))

    # ------------------------------------------------------------------------------------------------ session
    def register(self, spec: EstimatorSpec, *, replace: bool = False, origin: str = "register_estimator()") -> EstimatorSpec:
        """Add ``spec`` for this process; ValueError when its name is taken (unless ``replace``)."""
        validate_spec(spec)
        self.discover()
        if spec.name in self._specs and not replace and self._specs[spec.name] is not spec:
            raise ValueError(f"an estimator named {spec.name!r} is already registered ({self._origins[spec.name]}); "
                             "choose another name or pass replace=True")
        self._specs[spec.name] = spec
        self._origins[spec.name] = origin
        self._errors = [error for error in self._errors if error.name != spec.name]
        return spec

    def unregister(self, name: str) -> None:
        """Remove ``name`` (a session registration, typically); KeyError when it is not registered."""
        self.discover()
        if name not in self._specs:
            raise KeyError(f"no estimator named {name!r} is registered")
        del self._specs[name]
        del self._origins[name]

    # ------------------------------------------------------------------------------------------------ lookup
    def names(self) -> list[str]:
        self.discover()
        return list(self._specs)

    def get(self, name: str) -> EstimatorSpec:
        self.discover()
        if isinstance(name, str) and name in self._specs:
            return self._specs[name]
        for error in self._errors:
            if error.name == name:
                raise ValueError(str(error))
        raise ValueError(f"unknown estimator {name!r}; known estimators: {', '.join(self._specs)}")

    def origin(self, name: str) -> str:
        self.get(name)
        return self._origins[name]

    def session_specs(self, names: Iterable[str]) -> list[EstimatorSpec]:
        """The specs among ``names`` registered by :meth:`register` (not by an entry point)."""
        self.discover()
        return [self._specs[n] for n in names if n in self._specs and self._origins[n] == "register_estimator()"]

    def errors(self) -> list[PluginError]:
        self.discover()
        return list(self._errors)


_REGISTRY = EstimatorRegistry()


def register_estimator(spec: EstimatorSpec, *, replace: bool = False) -> EstimatorSpec:
    """Register ``spec`` for this process: ``randattn.estimate``, ``mse`` and the reports then know it.

    Parameters
    ----------
    spec : EstimatorSpec
        Checked with :func:`~randattn.estimators.base.validate_spec` first.
    replace : bool
        Replace an estimator of the same name instead of refusing.

    Returns
    -------
    EstimatorSpec
        ``spec``, so that it can be used as ``SPEC = register_estimator(EstimatorSpec(...))``.

    Raises
    ------
    SpecError
        The spec does not satisfy the protocol (every problem listed).
    ValueError
        Its name is taken (the message says by whom).
    """
    return _REGISTRY.register(spec, replace=replace)


def unregister_estimator(name: str) -> None:
    """Remove estimator ``name`` from this process's registry."""
    _REGISTRY.unregister(name)


def list_estimators() -> list[str]:
    """Registered estimator names: the built-ins in catalogue order, then plugins by name, then session ones."""
    return _REGISTRY.names()


def get_spec(name: str) -> EstimatorSpec:
    """The spec of estimator ``name``; ``ValueError`` listing the known names (or the plugin's error) otherwise."""
    return _REGISTRY.get(name)


def spec_origin(name: str) -> str:
    """Where estimator ``name`` was registered from (entry point and package, or ``register_estimator()``)."""
    return _REGISTRY.origin(name)


def session_specs(names: Iterable[str]) -> list[EstimatorSpec]:
    """The specs among ``names`` that this process registered with :func:`register_estimator`.

    Other processes (Dask workers) find entry-point plugins themselves; these must be sent to them.
    """
    return _REGISTRY.session_specs(names)


def ensure_registered(specs: Iterable[EstimatorSpec]) -> None:
    """Register each of ``specs`` in this process unless a spec of that name is there already (a Dask worker)."""
    for spec in specs:
        if spec.name not in _REGISTRY.names():
            _REGISTRY.register(spec)


def plugin_errors() -> list[PluginError]:
    """The plugins that could not be registered, each with its reason."""
    return _REGISTRY.errors()


def takes_no_samples(label: str) -> bool:
    """Whether the configuration ``label`` (a table's, e.g. ``"vattention:budget=fixed"``) takes no S, as its
    spec says for its parameters (:meth:`~randattn.estimators.base.EstimatorSpec.needs_samples_of`): the sweep
    measures it once and repeats its row at each S. False for an estimator not registered in this process (its
    rows are kept as they are)."""
    try:
        name, params = parse_estimator(label)
        return not get_spec(name).needs_samples_of(params)
    except (KeyError, TypeError, ValueError):
        return False


def parse_estimator(text: str) -> tuple[str, dict[str, Any]]:
    """Parse ``"name"`` or ``"name:param=value,param=value"`` into a name and typed parameters.

    Values are converted by the parameter's declared default type (int, float, bool, str). A
    parameter given twice is refused (the last one silently winning would hide a typo).
    """
    name, colon, rest = text.partition(":")
    name = name.strip()
    spec = get_spec(name)
    params: dict[str, Any] = {}
    items = [part.strip() for part in rest.split(",")] if colon else []
    if "" in items:  # "rfa:" or "rfa:a=1,,b=2": an option lost to a typo would run the default silently
        raise ValueError(f"estimator {text!r} has an empty option (nothing after ':', between two commas or after "
                         f"the last one); write {name!r} alone for its defaults, or '{name}:param=value,param=value'")
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep:
            raise ValueError(f"estimator option {item!r} in {text!r} must look like param=value")
        if key in params:
            raise ValueError(f"parameter {key!r} is given twice in {text!r}")
        if key == "preset":
            params[key] = raw.strip()
            continue
        if key not in spec.params:
            raise UnknownParameterError(name, [key], [*sorted(spec.params), "preset"], spec.needs_samples is not False)
        params[key] = _convert(raw.strip(), spec.params[key].default, spec.params[key].kind)
    spec.resolve_params(params)
    return name, params


def _convert(raw: str, default: Any, kind: Any = None) -> Any:
    """``raw`` as the parameter's type: its default's, or, where the parameter takes int and float alike (a count
    or a fraction, as vAttention's ``top_k``), as the literal is written (``1`` a count, ``1.0`` a fraction)."""
    if isinstance(kind, tuple) and int in kind and float in kind:
        default = None
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
    """One record per estimator: name, display name, summary, parameters (default and choices), complexity,
    randomness, every declared fact of its default configuration (cost, convergence, S, signed weights,
    diagnostics, masks, normalization, selection, query placement, whether it reports the keys it reads and its
    log-denominator, its promise, exact limits, optional batched forms, stacked draw, memory), where it comes
    from, and presets (name -> the parameters it sets; ``paper`` = the defaults)."""
    records = []
    for name in list_estimators():
        spec = get_spec(name)
        defaults = spec.resolve_params({})
        records.append(
            {
                "name": name,
                "display_name": spec.family_name,
                "summary": spec.summary,
                "source": spec.source,
                "complexity": spec.complexity,
                "cost": spec.cost_of(defaults),
                "convergence": spec.convergence_of(defaults),
                "random": spec.is_random(defaults),
                "needs_samples": spec.needs_samples_of(defaults),
                "signed_weights": spec.has_signed_weights(defaults),
                "diagnostics": spec.diagnostics_apply(defaults),
                "masks": ["none" if m is None else m for m in spec.masks_of(defaults)],
                "normalized": spec.normalized,
                "selection": spec.selection_of(defaults),
                "query_placement": spec.query_placement_of(defaults),
                "keys_used": spec.keys_used is not None,
                "log_denominator": spec.log_denominator is not None,
                "promise": None if (promise := spec.promise_of(defaults)) is None else
                dict(zip(("epsilon", "delta"), promise), on=spec.promise_on_of(defaults)),
                "exact_limits": [limit.description for limit in spec.exact_limits],
                "forms": list(spec.forms.declared),
                "stacked_draw": spec.stacked_draw,
                "memory": spec.memory_hint,
                "origin": spec_origin(name),
                "parameters": {
                    p: {"default": param.default, "choices": list(param.choices) if param.choices else None, "doc": param.doc}
                    for p, param in spec.params.items()
                },
                "presets": {preset: dict(spec.presets.get(preset, {})) for preset in spec.preset_names()},
            }
        )
    return records
