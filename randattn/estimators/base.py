"""Bookkeeping shared by every estimator: the draws container and the estimator spec.

Sampling is separate from estimation (ARCHITECTURE sec. 3): ``draw`` makes every random
variable an estimator uses, as float64 numpy arrays with a leading replicate dim, and
``estimate(q, k, v, draws, scale=..., **params)`` is a pure function of them. The
reference (numpy, float64) and batched (torch) forms consume the same ``Draws``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from randattn._validation import check_choice

__all__ = ["Draws", "Param", "EstimatorSpec"]


@dataclass(frozen=True)
class Draws:
    """The random variables of one estimator call.

    Attributes
    ----------
    arrays : mapping of str to array
        Each array has a leading replicate dim ``R`` followed by the batch dims of the
        inputs, e.g. ``omega : (R, ..., S, D)``. numpy float64 as drawn; torch tensors
        after :meth:`to_torch`.
    replicates : int
        ``R``, the number of independent replicates.
    """

    arrays: Mapping[str, Any]
    replicates: int

    def __getitem__(self, key: str) -> Any:
        try:
            return self.arrays[key]
        except KeyError:
            raise KeyError(
                f"draws have no {key!r}; they hold {sorted(self.arrays)} "
                "(were they made by another estimator's draw()?)"
            ) from None

    def __contains__(self, key: str) -> bool:
        return key in self.arrays

    def to_torch(self, device: Any = None, dtype: Any = None) -> "Draws":
        """The same draws as torch tensors on ``device`` (values are copied, not redrawn)."""
        import torch

        dtype = torch.float64 if dtype is None else dtype
        return Draws(
            {k: torch.as_tensor(np.asarray(a), dtype=dtype, device=device) for k, a in self.arrays.items()},
            self.replicates,
        )


@dataclass(frozen=True)
class Param:
    """One estimator parameter: its default, what is allowed, and what it means."""

    default: Any
    doc: str
    choices: tuple[Any, ...] | None = None
    kind: type | tuple[type, ...] | None = None

    def check(self, name: str, value: Any) -> Any:
        if self.choices is not None:
            return check_choice(name, value, self.choices)
        if self.kind is not None and not isinstance(value, self.kind) or isinstance(value, bool) and self.kind in (int, float):
            expected = self.kind.__name__ if isinstance(self.kind, type) else "/".join(t.__name__ for t in self.kind)
            raise TypeError(f"{name} must be {expected}, got {type(value).__name__} {value!r}")
        return value


@dataclass(frozen=True)
class EstimatorSpec:
    """What the registry knows of an estimator.

    Attributes
    ----------
    name : str
        Registry name (``"rfa"``, ``"ra"``, ...).
    summary : str
        One line: what it estimates and how.
    source : str
        Paper and equations it implements.
    complexity : str
        Time complexity in N (queries), M (keys), S (samples), D, Dv.
    params : mapping of str to Param
        Estimator options with the papers' defaults.
    draw : callable
        ``draw(q_shape, k_shape, *, num_samples, replicates, rng, **params) -> Draws``.
    reference : callable
        numpy float64 ``estimate(q, k, v, draws, *, scale, **params) -> (R, ..., N, Dv)``.
    batched : callable
        torch form of ``reference`` with the same signature and layout.
    needs_samples : bool
        Whether ``num_samples`` is required.
    is_random : callable
        ``is_random(params) -> bool``: False for deterministic variants (softmax, ``sample="mean"``).
    variants : mapping of str to params
        Parameter sets the common test suite runs (batched == reference, shapes, seeds).
    batched_probabilities : callable or None
        torch ``probabilities(q, k, draws, *, scale, **params) -> (R, ..., N, M)``: the attention
        probabilities the estimator implies, equal (to rounding) to ``batched`` with
        ``v = I_M`` but without the ``(., M) x (M, M)`` products the identity would cost.
        None: the sweep calls ``batched`` with ``v = I_M``.
    batched_with_probabilities : callable or None
        torch ``estimate_with_probabilities(q, k, v, draws, *, scale, **params) -> (out, probs)``:
        ``batched(q, k, v, ...)`` and ``batched_probabilities(q, k, ...)``, the same bits, from one
        pass that computes their common terms (the draws' features, the weights) once. None: the
        sweep calls the two separately.
    batched_with_float32_probabilities : callable or None
        torch ``(q, k, v, draws, *, scale, **params) -> (out, probs, bound)`` for float64 runs:
        ``out`` as ``batched``, the probabilities from a float32 product, and ``bound (R, ..., N)``
        on each row's distance from the full-precision probabilities in the 2-norm. The sweep uses
        it when the bound shows the rounding negligible against the squared error it measures, and
        ``batched_with_probabilities`` otherwise. None: probabilities in the run's dtype.
    batched_with_probability_factors : callable or None
        torch ``(q, k, v, draws, *, scale, **params) -> (out, left, right)`` or None: ``out`` as
        ``batched`` (the same bits) and the implied probabilities' factors, ``probabilities = left @
        right`` with ``left (R, ..., N, J)`` and ``right (R, ..., J, M)`` with entries in [0, 1];
        None where a variant has no such factors. The sweep measures the probability error from
        them without forming the ``(N, M)`` matrix (:mod:`randattn.analysis.probability_error`).
    presets : mapping of str to params
        Named parameter sets selected by the ``preset`` parameter (e.g. ``"official-code"``: the
        conventions of the authors' code); ``"paper"`` (the defaults) is always allowed. Explicit
        parameters override the preset's (see :meth:`resolve_params`).
    """

    name: str
    summary: str
    source: str
    complexity: str
    params: Mapping[str, Param]
    draw: Callable[..., Draws]
    reference: Callable[..., Any]
    batched: Callable[..., Any]
    needs_samples: bool = True
    is_random: Callable[[Mapping[str, Any]], bool] = field(default=lambda params: True)
    variants: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    presets: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    batched_probabilities: Callable[..., Any] | None = None
    batched_with_probabilities: Callable[..., Any] | None = None
    batched_with_float32_probabilities: Callable[..., Any] | None = None
    batched_with_probability_factors: Callable[..., Any] | None = None

    def preset_names(self) -> tuple[str, ...]:
        """Allowed values of ``preset``: ``"paper"`` (the defaults) and the declared presets."""
        return ("paper", *(name for name in self.presets if name != "paper"))

    def expand_preset(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """``params`` with ``preset`` replaced by the parameters it stands for; explicit ones win.

        Raises ValueError naming the preset and the allowed ones when it is unknown.
        """
        params = dict(params)
        preset = params.pop("preset", "paper")
        if not isinstance(preset, str) or preset not in self.preset_names():
            raise ValueError(
                f"unknown preset {preset!r} for estimator {self.name!r}; allowed: {', '.join(self.preset_names())}"
            )
        return {**self.presets.get(preset, {}), **params}

    def resolve_params(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """Fill in defaults; reject unknown names and disallowed values with a clear error.

        A ``preset`` entry is expanded first (:meth:`expand_preset`); the result holds the
        expanded parameters only, never ``preset`` itself, so estimators need not know of it.
        """
        params = self.expand_preset(params)
        unknown = sorted(set(params) - set(self.params))
        if unknown:
            allowed = ", ".join([*sorted(self.params), "preset"])
            raise ValueError(
                f"unknown parameter(s) {', '.join(map(repr, unknown))} for estimator {self.name!r}; "
                f"allowed: {allowed}"
            )
        resolved = {}
        for name, param in self.params.items():
            value = params.get(name, param.default)
            resolved[name] = param.check(name, value)
        return resolved
