r"""The forms of an estimator that attends to weighted keys, written once for both backends.

Each decode-time estimator (package docstring) makes, for a batch of queries, two arrays: the masked logits
:math:`l_{nm}` (``-inf`` where the mask hides key m) and its log weights :math:`\log w_{nm}` (``-inf`` for a key
left out). Everything it returns follows from their sum, the weighted scores :math:`\log w + l`:

- the estimate, :math:`\sum_m p_{nm} v_m` with :math:`p_n = \operatorname{softmax}(\log w_n + l_n)`;
- the implied probabilities :math:`p_{nm}`;
- the keys each query reads: those with a finite log weight that it may see;
- the log of the estimated softmax normaliser, :math:`\log \hat D_n = \operatorname{logsumexp}_m(\log w + l)`.

:class:`WeightedKeysForms` writes these forms once, over a backend's array operations (:mod:`.reference` in numpy
float64, :mod:`.batched` in torch), so that an estimator's reference and batched forms differ only in how each
makes its two arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

import numpy as np

from randattn.estimators.base import Draws, EstimatorOptions, keyword_entry

__all__ = ["WeightedKeysForms", "no_values"]


@dataclass(frozen=True)
class WeightedKeysForms:
    """An estimator's forms from its weighted scores, in one backend.

    Attributes
    ----------
    options_type : type
        The family's options: the keywords of the forms :meth:`entries` makes, checked when one is called.
    weighted_scores : callable
        ``weighted_scores(q, k, v, draws, options) -> (logits, log_weights, v)`` in the backend's arrays, after every
        check: ``logits : (..., N, M)`` masked, ``log_weights`` broadcasting against them with a leading replicate
        dim ``(R, ..., N, M)``, or without one where ``same_in_every_replicate``; ``v : (..., M, Dv)`` prepared.
        The forms that read no values pass zeros ``(..., M, 1)`` of ``k``'s kind as ``v`` (:func:`no_values`).
    backend : module
        :mod:`randattn.estimators.sparse.reference` or :mod:`randattn.estimators.sparse.batched`: ``attention``,
        ``keys_used``, ``log_denominator`` and ``repeated``.
    same_in_every_replicate : bool
        The selection is made once (a deterministic rule): every form's result is repeated over the draws'
        replicates.
    """

    options_type: type[EstimatorOptions]
    weighted_scores: Callable[..., tuple[Any, Any, Any]]
    backend: ModuleType
    same_in_every_replicate: bool = False

    @classmethod
    def of_selection(cls, options_type: type[EstimatorOptions], select: Callable[..., Any],
                     prepare: Callable[..., tuple[Any, ...]], backend: ModuleType) -> WeightedKeysForms:
        """The forms of a family whose ``select(q, k, draws, options)`` returns an object holding its masked
        ``logits`` and ``log_weights`` (vAttention's :class:`~randattn.estimators.vattention.reference.Selection`);
        ``prepare`` (``prepare_reference`` or ``prepare_batched``) checks the inputs, the values with them, first."""
        def weighted_scores(q: Any, k: Any, v: Any, draws: Draws, options: EstimatorOptions) -> tuple[Any, Any, Any]:
            _, _, v, _, _ = prepare(q, k, v, options.scale)
            chosen = select(q, k, draws, options)
            return chosen.logits, chosen.log_weights, v

        weighted_scores.__module__ = select.__module__  # the family's module, where its forms are bound
        return cls(options_type, weighted_scores, backend)

    def entries(self, *names: str, module: str | None = None) -> tuple[Callable[..., Any], ...]:
        """The forms named, as the public functions ``f(q, k, [v,] draws, *, scale, **options)`` of ``module``
        (:func:`~randattn.estimators.base.keyword_entry` over ``options_type``), where the caller binds them to
        those names: ``module`` is the module of ``weighted_scores`` unless given."""
        entry = keyword_entry(self.options_type)
        forms = tuple(entry(getattr(self, name)) for name in names)
        for name, form in zip(names, forms):
            # a module's functions to their callers: "estimate(): ..." in an error, and pickled by that name
            form.__qualname__ = form.__name__ = name
            form.__module__ = module or self.weighted_scores.__module__
        return forms

    def _scores(self, q: Any, k: Any, v: Any, draws: Draws, options: EstimatorOptions) -> tuple[Any, Any, Any, Any]:
        """``(scores, log_weights, logits, v)``: the weighted scores ``log w + l`` and what they were made of."""
        logits, log_weights, v = self.weighted_scores(q, k, v, draws, options)
        return logits + log_weights, log_weights, logits, v

    def _per_replicate(self, draws: Draws, *values: Any) -> tuple[Any, ...]:
        if not self.same_in_every_replicate:
            return values
        return tuple(self.backend.repeated(value, draws.replicates) for value in values)

    def estimate_with_probabilities(self, q: Any, k: Any, v: Any, draws: Draws, options: EstimatorOptions
                                    ) -> tuple[Any, Any]:
        """``(out (R, ..., N, Dv), probabilities (R, ..., N, M))`` from one selection: the same bits as
        ``estimate`` and ``probabilities``."""
        scores, _, _, v = self._scores(q, k, v, draws, options)
        return self._per_replicate(draws, *self.backend.attention(scores, v))

    def estimate_with_probabilities_and_keys_used(self, q: Any, k: Any, v: Any, draws: Draws,
                                                  options: EstimatorOptions) -> tuple[Any, Any, Any]:
        """``(out, probabilities, keys_used)`` from one selection, the same bits as the three forms."""
        scores, log_weights, logits, v = self._scores(q, k, v, draws, options)
        return self._per_replicate(draws, *self.backend.attention(scores, v),
                                   self.backend.keys_used(log_weights, logits))

    def estimate_with_probabilities_keys_used_and_log_denominator(
            self, q: Any, k: Any, v: Any, draws: Draws, options: EstimatorOptions) -> tuple[Any, Any, Any, Any]:
        """``(out, probabilities, keys_used, log_denominator)`` from one selection, the same bits as the four forms:
        the weighted scores formed once for the softmax and the logsumexp."""
        scores, log_weights, logits, v = self._scores(q, k, v, draws, options)
        return self._per_replicate(draws, *self.backend.attention(scores, v),
                                   self.backend.keys_used(log_weights, logits), self.backend.log_denominator(scores))

    def estimate(self, q: Any, k: Any, v: Any, draws: Draws, options: EstimatorOptions) -> Any:
        """``(R, ..., N, Dv)``: attention over each query's weighted keys (the probabilities are not repeated over
        the replicates: an (R, ..., N, M) array less)."""
        scores, _, _, v = self._scores(q, k, v, draws, options)
        return self._per_replicate(draws, self.backend.attention(scores, v)[0])[0]

    def probabilities(self, q: Any, k: Any, draws: Draws, options: EstimatorOptions) -> Any:
        """``(R, ..., N, M)``: the implied attention probabilities, :math:`w_{nm} e^{l_{nm}} / \\hat D_n` (zero off the
        keys the query reads)."""
        scores, _, _, v = self._scores(q, k, no_values(k), draws, options)
        return self._per_replicate(draws, self.backend.attention(scores, v)[1])[0]

    def keys_used(self, q: Any, k: Any, draws: Draws, options: EstimatorOptions) -> Any:
        """``(R, ..., N)`` float64: the keys each query's estimate reads (a finite weight, and visible)."""
        logits, log_weights, _ = self.weighted_scores(q, k, no_values(k), draws, options)
        return self._per_replicate(draws, self.backend.keys_used(log_weights, logits))[0]

    def log_denominator(self, q: Any, k: Any, draws: Draws, options: EstimatorOptions) -> Any:
        r"""``(R, ..., N)`` float64: :math:`\log \hat D_n`, the log of the estimated softmax normaliser
        :math:`\sum_m w_{nm} e^{l_{nm}}`."""
        scores, _, _, _ = self._scores(q, k, no_values(k), draws, options)
        return self._per_replicate(draws, self.backend.log_denominator(scores))[0]


def no_values(k: Any) -> Any:
    """``(..., M, 1)`` zeros of ``k``'s kind and dtype: the values the input checks ask for where none are read."""
    if hasattr(k, "new_zeros"):  # a torch tensor
        return k.new_zeros((*k.shape[:-1], 1))
    k = np.asarray(k)
    return np.zeros((*k.shape[:-1], 1), dtype=k.dtype)
