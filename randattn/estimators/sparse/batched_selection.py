"""Deterministic key selection in torch: the batched forms of :mod:`randattn.estimators.sparse.selection`.

Nothing here reads a value back to the host from an accelerator: the selection takes S as a 0-d tensor
(``select(x, y, logits, budget, options)`` with ``budget`` a tensor), the kept keys are the rows' ranks below it.
S is read and checked against the parameters (``options.check_budget``) only where the draws are on the CPU; on an
accelerator the parameters are checked without it (when the options are made) and S was checked when ``draw`` made
the draws.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, ClassVar

import torch

from randattn.estimators._prepare import check_draw_array, prepare_batched, to_torch_draws
from randattn.estimators.base import Draws
from randattn.estimators.sparse import batched as sparse_batched
from randattn.estimators.sparse.selection import KeptKeysForms, KeptKeysOptions, budget_of

__all__ = ["KeptKeysBatched", "log_weights_of", "top_ranked"]


def log_weights_of(keep: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    r""":math:`\log w` in the dtype and device of ``like``: 0 where ``keep``, ``-inf`` where the key is left out."""
    zero = torch.zeros((), dtype=like.dtype, device=like.device)
    return torch.where(keep, zero, float("-inf"))


def top_ranked(scores: torch.Tensor, count: int | torch.Tensor) -> torch.Tensor:
    """``(..., L)`` boolean: the ``count`` largest ``scores`` per row; ties to the lower index (a stable sort), as in
    :func:`randattn.estimators.sparse.selection.top_ranked`. ``count`` may be a tensor (no host read): an entry is
    kept when its rank in the row is below it."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    positions = torch.arange(scores.shape[-1], device=scores.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(-1, order, positions)
    return rank < count


@dataclass(frozen=True)
class KeptKeysBatched(KeptKeysForms):
    """The torch forms of a deterministic selection estimator (:class:`~randattn.estimators.sparse.selection.
    KeptKeysForms`, ``select`` on tensors, S a 0-d tensor)."""

    backend: ClassVar[ModuleType] = sparse_batched

    def forms(self) -> tuple[Callable[..., Any], ...]:
        """``(estimate, estimate_with_probabilities, probabilities, keys_used,
        estimate_with_probabilities_and_keys_used)``, an estimator's batched functions (the module of ``select``),
        each ``f(q, k, [v,] draws, *, scale=None, mask=None, **options)``."""
        return self.weighted_keys_forms().entries("estimate", "estimate_with_probabilities", "probabilities",
                                                  "keys_used", "estimate_with_probabilities_and_keys_used",
                                                  module=self.select.__module__)

    def _log_weights(self, q: Any, k: Any, v: Any, draws: Draws, options: KeptKeysOptions
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, y, v, _, batch = prepare_batched(q, k, v, options.scale)
        draws = to_torch_draws(draws, like=x)
        budget = check_draw_array(draws, "budget", batch, ())
        if budget.device.type == "cpu":
            options.check_budget(budget_of(draws, batch))
        logits = sparse_batched.masked_logits(x, y, options.mask)
        keep = self.select(x, y, logits, budget.reshape(-1)[0], options)
        return logits, log_weights_of(keep, logits), v
