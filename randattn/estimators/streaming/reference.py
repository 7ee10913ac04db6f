r"""StreamingLLM's sinks + recent window (Xiao et al. 2023, sec. 3.2, fig. 4), numpy float64 (the reference form).

Query :math:`n` is token :math:`t_n = n + M - N` (the last N of M tokens). It keeps the first ``sinks`` keys (the
attention sinks) and the ``window = S - sinks`` keys ending at key :math:`e_n`, and attends to them exactly:

.. math::
    K_n = \{0, \dots, \text{sinks} - 1\} \cup \{e_n - \text{window} + 1, \dots, e_n\},
    \qquad e_n = \max(t_n,\ \min(S, M) - 1),

intersected with the keys the query may see. :math:`e_n = t_n` once S keys precede the query (the rolling cache
is full: sinks and window are disjoint, S keys). Before that (:math:`t_n < S - 1`) the cache still holds every
token, :math:`K_n = \{0, \dots, \min(S, M) - 1\}`: under the causal mask those are all the keys the query sees;
without a mask it also sees those first S keys after it (and a query before the first key, :math:`t_n < 0` when
N > M, sees them too). So ``keys_used = min(S, visible keys)`` under both masks.

Under ``mask="sliding:W"`` the rule is the same and the window hides what it hides from exact attention: the sinks
are tokens :math:`0, \dots, \text{sinks} - 1` of the sequence, so a query whose window has passed them keeps the
recent keys inside its window alone, :math:`\min(\text{window}, W)` keys. The estimator stays an estimate of the
layer's own (windowed) attention, reading no key the layer hides; ``keys_used`` counts what is read. Such a query
needs a recent window: S > sinks is required under a sliding mask (:meth:`StreamingOptions.check_budget`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from randattn._validation import check_positive_int
from randattn.estimators.base import option
from randattn.estimators.masks import DECLARABLE_MASKS, Mask
from randattn.estimators.sparse.selection import KeptKeysOptions, KeptKeysReference, deprecated_check_params

__all__ = ["StreamingOptions", "estimate", "keys_used", "kept_keys", "probabilities"]


@dataclass(frozen=True, kw_only=True)
class StreamingOptions(KeptKeysOptions):
    """StreamingLLM's keyword options, declared once: the spec's ``params``, ``draw``'s and every form's keywords.

    ``sinks >= 0``, and S >= ``sinks`` (S = sinks + window, window >= 0; :meth:`check_budget`), S > ``sinks``
    under a sliding window.
    """

    #: the rule reads positions only; a window hides the sinks it has passed (module docstring)
    declared_masks: ClassVar[tuple[str | None, ...]] = DECLARABLE_MASKS

    sinks: int = option(4, "initial keys every query keeps (the attention sinks; 4 in the paper, sec. 3.2)", kind=int)

    def check(self) -> None:
        super().check()
        check_positive_int("sinks", self.sinks, minimum=0)

    def check_budget(self, budget: Any) -> int:
        budget = super().check_budget(budget)
        if budget < self.sinks:
            raise ValueError(f"num_samples S={budget} must be >= sinks={self.sinks}: S = sinks + window counts the "
                             f"sink keys and the recent window (window >= 0); use S >= {self.sinks} or fewer sinks")
        if budget == self.sinks and Mask.parse(self.mask).window is not None:
            raise ValueError(f"num_samples S={budget} equals sinks={self.sinks} under mask={self.mask!r}: the window "
                             "passes the sink keys, and with no recent window a later query would keep no key; use "
                             f"S > {self.sinks} (S = sinks + window, window >= 1)")
        return budget


def kept_keys(x: np.ndarray, y: np.ndarray, logits: np.ndarray, budget: int, options: StreamingOptions) -> np.ndarray:
    """``(N, M)`` boolean: the ``sinks`` and the recent window of each query (module docstring), one query at a time.

    The ``select`` of :class:`~randattn.estimators.sparse.selection.KeptKeysReference` (its arguments there), with
    ``budget`` S = sinks + window; ``logits`` is unused: the keys are chosen by position alone (the mask's hidden
    keys drop out afterwards).
    """
    sinks = options.sinks
    num_queries, num_keys = x.shape[-2], y.shape[-2]
    window = budget - sinks
    keep = np.zeros((num_queries, num_keys), dtype=bool)
    for n in range(num_queries):
        token = n + num_keys - num_queries
        end = max(token, min(budget, num_keys) - 1)  # the rolling cache starts evicting once it holds S tokens
        keep[n, :sinks] = True
        keep[n, max(end - window + 1, 0): end + 1] = True
    return keep


estimate, probabilities, keys_used = KeptKeysReference(StreamingOptions, kept_keys).forms()


def __getattr__(name: str) -> Any:
    if name == "check_params":  # deprecated: the options check themselves
        return deprecated_check_params(StreamingOptions, "streaming")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
