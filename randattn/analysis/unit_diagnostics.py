r"""The importance-sampling diagnostics of a unit, block by block.

:class:`UnitDiagnostics` gathers Kish's ESS and the delta-method variance per (replicate, cell)
and Pareto k-hat per cell over a unit's blocks (by
:func:`~randattn.analysis.diagnostics.replicate_snis_diagnostics`), on the first
:data:`DIAGNOSTIC_REPLICATES` replicates only, and reduces them to the unit's per-cell columns.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from randattn.analysis.masking import diagnostics_skip_reason
from randattn.analysis.plan import EstimatorConfig
from randattn.estimators.base import Draws

__all__ = ["DIAGNOSTIC_REPLICATES", "DiagnosticsSkippedWarning", "UnitDiagnostics", "diagnostics_block"]

#: importance-sampling diagnostics (ESS, delta-method variance) are averaged over the first replicates only: they
#: describe the weights' spread, which 8 replicates of every query already show, at a quarter of the cost for R = 32
DIAGNOSTIC_REPLICATES = 8


class DiagnosticsSkippedWarning(UserWarning):
    """The IS diagnostics of a configuration were not computed under the run's mask (its providers take none)."""


def diagnostics_block(spec, est: EstimatorConfig, q, k, v, draws: Draws, first_block: bool, *, scale: float,
                      khat_queries: int, backend: str, device: Any, dtype: str, mask: str | None = None):
    """Per (replicate, cell) ESS and delta-method variance ``(R_b, C_b)``, and k-hat ``(C_b,)`` or None.

    None under a mask the spec's importance-weight provider does not take
    (:func:`~randattn.analysis.masking.diagnostics_skip_reason`): bidirectional weights would
    describe another estimator.

    Parameters
    ----------
    spec : EstimatorSpec
        ``est``'s spec.
    est : EstimatorConfig
    q, k, v : float64 ndarrays
        The block's cells.
    draws : Draws
        The block's draws.
    first_block : bool
        Whether the block holds the unit's first replicates: only they get k-hat (on ``khat_queries`` queries).
    scale : float
    khat_queries : int
    backend : str
        ``"torch"`` or ``"reference"``.
    device : torch.device or None
    dtype : str
        The run's dtype name for ``est``.
    mask : str, optional
        The layer's mask kind.
    """
    from randattn.analysis.diagnostics import replicate_snis_diagnostics

    if diagnostics_skip_reason(spec, est.params, mask, backend) is not None:
        return None
    return replicate_snis_diagnostics(
        est.name, q, k, v, draws, scale=scale, params=est.params,
        khat_queries=khat_queries if first_block else 0,
        backend=backend, device=device, dtype=dtype, mask=mask,
    )


class UnitDiagnostics:
    """A unit's ESS, delta-method variance and k-hat, filled block by block (NaN where not computed).

    Parameters
    ----------
    reps : int
        The unit's replicates R.
    cells : int
        The unit's cells C.
    """

    def __init__(self, reps: int, cells: int) -> None:
        self.ess = np.full((reps, cells), np.nan)
        self.delta = np.full((reps, cells), np.nan)
        self.khat = np.full(cells, np.nan)

    @staticmethod
    def wanted(rs: slice) -> slice | None:
        """The replicates of the block ``rs`` that are diagnosed (the first :data:`DIAGNOSTIC_REPLICATES`), or None."""
        if rs.start >= DIAGNOSTIC_REPLICATES:
            return None
        return slice(rs.start, min(rs.stop, DIAGNOSTIC_REPLICATES))

    def add(self, used: slice, cs: slice, diag) -> None:
        """Stores a block's :func:`diagnostics_block` result for replicates ``used`` and cells ``cs`` (None: skipped)."""
        if diag is None:
            return
        self.ess[used, cs], self.delta[used, cs] = diag.ess, diag.delta_variance
        if diag.khat is not None:
            self.khat[cs] = diag.khat

    def columns(self, variance: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per cell ``(ess_mean, delta_var_ratio, pareto_khat)``; the ratio to the estimate's ``variance`` (C,)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            delta_ratio = self.delta[:DIAGNOSTIC_REPLICATES].mean(0) / variance
        ess_mean = self.ess[:DIAGNOSTIC_REPLICATES].mean(0)
        return ess_mean, delta_ratio, self.khat
