r"""Deterministic key selection (top-k, StreamingLLM, Quest): the budget in the draws and the estimator forms.

Each of these estimators decides, from the inputs, the mask and the budget :math:`S`, which keys each query keeps,
``keep : (..., N, M)`` boolean, and returns exact softmax attention over the kept keys it may see:

.. math::
    \hat y_n = \frac{\sum_{m \in K_n} e^{x_n^\top y_m} v_m}{\sum_{m \in K_n} e^{x_n^\top y_m}},

the weighted attention of :mod:`randattn.estimators.sparse` with :math:`\log w_{nm} = 0` for :math:`m \in K_n` and
:math:`-\infty` otherwise. They have no random variables: their draws carry :math:`S` only, as
``budget : (R, ...)`` (the same value for every replicate and batch element), and every replicate returns the
same output.

:class:`KeptKeysReference` turns an estimator's options (its parameters, checked alone and against S) and
``select`` (its rule for ``keep``) into the numpy float64 ``estimate``, ``probabilities`` and ``keys_used``;
:class:`~randattn.estimators.sparse.batched_selection.KeptKeysBatched` does the same in torch; both through
:class:`~randattn.estimators.sparse.forms.WeightedKeysForms`, the forms every decode-time estimator shares.

What these estimators declare alike is said once here: their options' base :class:`KeptKeysOptions` (the mask,
and S checked against the parameters by :meth:`~KeptKeysOptions.check_budget`), their ``draw``
(:func:`budget_draw`) and the facts of their spec (:func:`kept_keys_spec`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, ClassVar, Sequence

import numpy as np

from randattn._validation import check_positive_int
from randattn.estimators._prepare import check_draw_array, prepare_reference
from randattn.estimators.base import Draws, EstimatorOptions, EstimatorSpec, family_spec, keyword_entry, never_random
from randattn.estimators.masks import MASKS, check_mask_argument
from randattn.estimators.sparse import reference as sparse_reference
from randattn.estimators.sparse.forms import WeightedKeysForms

__all__ = ["KeptKeysForms", "KeptKeysOptions", "KeptKeysReference", "budget_draw", "budget_draws", "budget_of",
           "kept_keys_spec", "log_weights_of", "top_ranked"]


@dataclass(frozen=True, kw_only=True)
class KeptKeysOptions(EstimatorOptions):
    """The keyword options of a deterministic selection estimator: ``mask`` here, a family's parameters in its
    subclass (fields made with :func:`~randattn.estimators.base.option`).

    The rules between the parameters go in :meth:`check` (a family's calls ``super().check()``), the rules tying
    them to S in :meth:`check_budget`: S is not an option (it comes with the draws), so it is checked where it is
    known, in ``draw`` and, from the draws, in every form.
    """

    #: the masks the family computes (its spec's ``masks``): None and ``"causal"`` here; ``"sliding"`` where the
    #: selection rule reads the visible keys alone, so that a window needs no rule of its own (top-k)
    declared_masks: ClassVar[tuple[str | None, ...]] = MASKS

    mask: str | None = None

    def check(self) -> None:
        check_mask_argument(self.mask, self.declared_masks)

    def check_budget(self, budget: Any) -> int:
        """S = ``num_samples`` against the parameters (here: a positive integer); ValueError/TypeError naming them."""
        return check_positive_int("num_samples", budget)


def budget_draws(q_shape: Sequence[int], num_samples: Any, replicates: int) -> Draws:
    """``Draws({"budget": (R, ...)})`` holding S = ``num_samples`` (a positive integer) for every replicate and batch
    element: a replicate dim followed by the batch dims, as every draw, so that a sweep may slice them by cell."""
    budget = check_positive_int("num_samples", num_samples)
    return Draws({"budget": np.full((replicates, *q_shape[:-2]), float(budget))}, replicates)


def budget_draw(options_type: type[KeptKeysOptions]) -> Callable[..., Draws]:
    """The ``draw`` of a deterministic selection estimator with the options ``options_type``.

    ``draw(q_shape, k_shape, *, num_samples, replicates=1, rng=None, mask=None, **params)``, its keywords the
    fields of ``options_type`` with their defaults (:func:`~randattn.estimators.base.keyword_entry`): it
    checks the parameters and S against them (:meth:`KeptKeysOptions.check_budget`) and returns
    :func:`budget_draws`.
    """
    @keyword_entry(options_type, leave_out=("scale",))
    def draw(q_shape: Sequence[int], k_shape: Sequence[int], *, num_samples: int, replicates: int = 1,
             rng: Any = None, options: KeptKeysOptions) -> Draws:
        return budget_draws(q_shape, options.check_budget(num_samples), replicates)

    draw.__doc__ = ("``budget : (R, ...)`` holding S after checking it against the parameters "
                    f"(``{options_type.__name__}.check_budget``); no random variables (``rng`` and ``mask`` do "
                    "not change the draws).")
    return draw


def budget_of(draws: Draws, batch_shape: Sequence[int]) -> int:
    """S from draws made by :func:`budget_draws` for inputs with these batch dims (numpy, or torch on the CPU).

    Raises ValueError when the draws have another shape or do not hold one positive integer.
    """
    values = check_draw_array(draws, "budget", batch_shape, ())
    values = np.asarray(values.detach().cpu() if hasattr(values, "detach") else values, dtype=np.float64).ravel()
    budget = values[0]
    if not (np.all(values == budget) and budget >= 1 and budget == np.floor(budget)):
        raise ValueError(f"draws['budget'] must hold one positive integer S throughout, got {np.unique(values)}: "
                         "were the draws made by this estimator's draw()?")
    return int(budget)


def log_weights_of(keep: np.ndarray) -> np.ndarray:
    r""":math:`\log w`: 0 where ``keep`` (the key is computed exactly), ``-inf`` where the key is left out."""
    return np.where(keep, 0.0, -np.inf)


def top_ranked(scores: np.ndarray, count: int) -> np.ndarray:
    """``(..., L)`` boolean: the ``count`` largest ``scores`` of each row (all of them when ``count >= L``).

    Ties go to the lower index (a stable sort of ``-scores``), so the choice is a function of the values alone;
    ``-inf`` scores rank last.
    """
    order = np.argsort(-scores, axis=-1, kind="stable")[..., :count]
    keep = np.zeros(scores.shape, dtype=bool)
    np.put_along_axis(keep, order, True, axis=-1)
    return keep


@dataclass(frozen=True)
class KeptKeysForms:
    """What a deterministic selection estimator gives to have its forms made: ``options_type`` and ``select``.

    Every form is the weighted attention over one selection, repeated over the replicates
    (:class:`~randattn.estimators.sparse.forms.WeightedKeysForms` with ``same_in_every_replicate``); a backend says
    how the selection's log weights are made: :class:`KeptKeysReference` in numpy float64,
    :class:`~randattn.estimators.sparse.batched_selection.KeptKeysBatched` in torch.

    Attributes
    ----------
    options_type : type
        The family's :class:`KeptKeysOptions`: the forms' keywords, checked when a form is called, and S checked
        against them (:meth:`KeptKeysOptions.check_budget`) once read from the draws.
    select : callable
        ``select(x, y, logits, budget, options) -> keep``: ``x : (..., N, D)``, ``y : (..., M, D)``, the masked
        logits ``(..., N, M)`` (``-inf`` where hidden); ``keep`` broadcasts against the logits. Kept hidden keys
        are dropped afterwards (their logit is ``-inf``).
    """

    options_type: type[KeptKeysOptions]
    select: Callable[..., Any]

    #: the backend's array operations (:mod:`.reference` or :mod:`.batched`), set by each backend's class
    backend: ClassVar[ModuleType]

    def weighted_keys_forms(self) -> WeightedKeysForms:
        """The forms, over this backend's log weights of the kept keys, repeated over the replicates."""
        return WeightedKeysForms(self.options_type, self._log_weights, self.backend, same_in_every_replicate=True)

    def _log_weights(self, q: Any, k: Any, v: Any, draws: Draws, options: KeptKeysOptions) -> tuple[Any, Any, Any]:
        """``(logits, log_weights, v)`` of the backend: the masked logits, the selection's log weights, the values."""
        raise NotImplementedError

    def __getattr__(self, name: str) -> Any:
        if name in _FORMER_METHODS:  # deprecated: the forms are WeightedKeysForms'
            warnings.warn(f"{type(self).__name__}.{name} is deprecated; use the functions that forms() returns, or "
                          f"{type(self).__name__}.weighted_keys_forms().{name}", DeprecationWarning, stacklevel=2)
            return getattr(self.weighted_keys_forms(), name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


#: the methods :class:`KeptKeysForms` had before its forms were :class:`WeightedKeysForms`'
_FORMER_METHODS = ("estimate", "estimate_with_probabilities", "estimate_with_probabilities_and_keys_used",
                   "probabilities", "keys_used")


@dataclass(frozen=True)
class KeptKeysReference(KeptKeysForms):
    """The numpy float64 forms of a deterministic selection estimator (:class:`KeptKeysForms`, ``select`` on
    arrays)."""

    backend: ClassVar[ModuleType] = sparse_reference

    def forms(self) -> tuple[Callable[..., np.ndarray], ...]:
        """``(estimate, probabilities, keys_used)``, the module-level functions of an estimator's reference (the
        module of ``select``), each ``f(q, k, [v,] draws, *, scale=None, mask=None, **options)``."""
        return self.weighted_keys_forms().entries("estimate", "probabilities", "keys_used",
                                                  module=self.select.__module__)

    def _log_weights(self, q: Any, k: Any, v: Any, draws: Draws, options: KeptKeysOptions
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        x, y, v, _, batch = prepare_reference(q, k, v, options.scale)
        budget = options.check_budget(budget_of(draws, batch))
        logits = sparse_reference.masked_logits(x, y, options.mask)
        return logits, log_weights_of(self.select(x, y, logits, budget, options)), v


def kept_keys_spec(*, options_type: type[KeptKeysOptions], reference: Any, batched: Any,
                   draw: Callable[..., Draws], **declared: Any) -> EstimatorSpec:
    """The spec of a deterministic selection estimator: what top-k, StreamingLLM and Quest declare alike.

    Its parameters are the fields of ``options_type``; the forms are ``reference.estimate`` and the protocol
    forms of the ``batched`` module (with its ``keys_used``); no configuration is random; it is normalized
    attention over the kept keys, under the masks of ``options_type.declared_masks``; and it makes no
    convergence claim: biased for S < M, exact once the kept keys cover every key (each family's
    ``exact_limits``), nothing in between. Every other fact (name, sources, ``selection``, ``exact_limits``, ...)
    is the family's, in ``declared``.
    """
    return family_spec(
        options_type, draw, reference, batched,
        keys_used=batched.keys_used,
        needs_samples=True,
        is_random=never_random,  # the selection is a function of the inputs and S
        convergence="none",
        cost="quadratic",
        normalized=True,
        masks=options_type.declared_masks,
        **declared,
    )


def deprecated_check_params(options_type: type[KeptKeysOptions], family: str) -> Callable[..., None]:
    """The former ``<family>.reference.check_params(budget, **params)``, kept with a DeprecationWarning naming its
    replacement, ``options_type(**params).check_budget(budget)`` (the parameters alone when ``budget`` is None)."""
    def check_params(budget: int | None, **params: Any) -> None:
        warnings.warn(f"randattn.estimators.{family}.reference.check_params is deprecated; use "
                      f"{options_type.__name__}(**params).check_budget(budget)", DeprecationWarning, stacklevel=2)
        options = options_type(**params)
        if budget is not None:
            options.check_budget(budget)

    return check_params
