r"""Executing a unit: inputs -> draws -> estimates -> metrics -> rows (ARCHITECTURE sec. 11, "execute").

:class:`UnitRunner` evaluates one :class:`~randattn.analysis.plan.Unit` (the cells of one
layer, estimator configuration, S and image over the selected heads) by the estimator's
batched torch form (the default; any device) or its float64 numpy reference, vectorized over
the cells and the R replicates. The same runner serves the in-process executor and Dask
workers.

Reproducibility across memory budgets
-------------------------------------
The budget splits a unit into blocks of (cells, replicates). Every reduction is first taken
per (replicate, cell) -- the squared error of the implied probabilities, Kish's ESS, the
delta-method variance -- and the blocks are joined before any reduction over replicates, so a
row is the same, bit for bit, whatever the budget (tested).

Memory
------
A block of c cells x r replicates is modelled to need ``c (a + b r)`` bytes: ``a`` per cell
whatever R, ``b`` per replicate. Both are calibrated once per (configuration, S, shape) by
:func:`~randattn.analysis.memory.measure_peak` on the code path that runs (the batched torch form
and its probability pass on the torch backend, the float64 reference otherwise; diagnostics
included) at one cell with one and two replicates, after a warm-up call, at S = 16 and 64, and
extrapolated linearly in S (every estimator's working set is affine in S), plus the stored
estimate. A unit whose single (cell, replicate) exceeds ``max_memory`` is refused with
:class:`MemoryBudgetError` before anything is computed.
"""

from __future__ import annotations

import re
import time
import warnings
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from randattn.analysis.masking import diagnostics_skip_reason, estimator_mask_kwargs, mask_label, visible_keys
from randattn.analysis.memory import measure_peak
from randattn.analysis.plan import EstimatorConfig, StackedGenerators, SweepConfig, Unit, replicate_rng
from randattn.analysis.positions import bucket_metrics, bucket_query_slices
from randattn.analysis.probability_error import factored_pays, factored_rounding_negligible, factored_sq_errors
from randattn.estimators.base import Draws

__all__ = ["COLUMNS", "PHASES", "DiagnosticsSkippedWarning", "MemoryBudgetError", "UnitResult", "UnitRunner",
           "exact_under_mask", "format_bytes", "run_recording"]

#: the sweep table's columns, in order (plotting code relies on these names)
COLUMNS: tuple[str, ...] = (
    "model", "image", "layer", "head", "tokens", "mask", "estimator", "params", "label", "num_samples", "replicates",
    "random", "mse", "mse_se", "variance", "bias_sq", "bias_sq_naive", "bias_sq_se", "rel_error", "prob_mse",
    "ess_mean", "delta_var_ratio", "pareto_khat", "dtype", "ref_max_abs_dev", "seconds", "seed", "sink_mass",
)

#: the parts of a unit's wall time that :meth:`UnitRunner.run_timed` reports: the exact attention (the first unit of
#: an image-layer computes it), the draws, the estimates with their probability error, the importance-sampling
#: diagnostics, the float64-reference spot check, and the metrics with the rows; on a GPU each phase ends at the host
#: transfer of its small results, so its time includes the device work queued before it
PHASES: tuple[str, ...] = ("exact", "draws", "estimate", "diagnostics", "reference_check", "metrics")

#: replicates per estimator call whenever the memory budget allows (see UnitRunner.blocks)
CANONICAL_REPLICATES = 8

#: importance-sampling diagnostics (ESS, delta-method variance) are averaged over the first replicates only: they
#: describe the weights' spread, which 8 replicates of every query already show, at a quarter of the cost for R = 32
DIAGNOSTIC_REPLICATES = CANONICAL_REPLICATES

#: S at which the working set is measured (then extrapolated linearly in S)
_CALIBRATION_SAMPLES = (16, 64)

#: a float64 run takes an estimator's float32 probability product (``batched_with_float32_probabilities``), and any
#: run the factored probability error (:mod:`~randattn.analysis.probability_error`), only where its rounding bound
#: changes every (replicate, cell)'s probability squared error by at most this fraction; a block where it may change
#: more is recomputed the dense way. Two orders below the ~10% standard error of a prob_mse over R = 32 replicates
PROBABILITY_ROUNDING_RTOL = 1e-3


class MemoryBudgetError(ValueError):
    """One (cell, replicate) of a unit needs more memory than ``max_memory`` allows."""


class DiagnosticsSkippedWarning(UserWarning):
    """The IS diagnostics of a configuration were not computed under the run's mask (its providers take none)."""


class UnitResult(NamedTuple):
    """What running a unit gives: its rows, the seconds of each phase, its per-position rows.

    Attributes
    ----------
    rows : list of dict
        One per head and reported S (:data:`COLUMNS`).
    seconds : dict
        Wall seconds of each of :data:`PHASES`.
    positions : list of dict or None
        One per head, reported S and position bucket
        (:data:`~randattn.analysis.positions.POSITION_COLUMNS`); None when the unit's layer gets
        no per-position metrics (:meth:`~randattn.analysis.plan.SweepConfig.positions_of`).
    """

    rows: list
    seconds: dict
    positions: list | None


def format_bytes(n: float) -> str:
    """``1536 -> '1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.3g} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.3g} TiB"  # pragma: no cover


def cell_draws(spec, config: EstimatorConfig, q_shape, k_shape, seeds: Sequence[int], reps: range, num_samples,
               mask: str | None = None) -> Draws:
    """Draws ``(len(reps), C, ...)`` for the cells with these seeds; replicate r of a cell from ``replicate_rng(seed, r)``.

    One ``draw`` call for the whole block, on a (replicates, cells) grid of generators
    (:class:`~randattn.analysis.plan.StackedGenerators`): the same bits as one call per
    (cell, replicate), at a fraction of the per-call cost (orthogonal features take one
    stacked QR instead of one per call). ``mask`` reaches ``draw`` only when it is set.
    """
    generators = StackedGenerators([[replicate_rng(seed, r) for seed in seeds] for r in reps])
    cells = len(seeds)
    return spec.draw((cells, *q_shape), (cells, *k_shape), num_samples=num_samples, replicates=len(reps),
                     rng=generators, **config.params, **estimator_mask_kwargs(mask))


def exact_under_mask(kind: str, q, k, v, scale: float, *, torch: Any = None) -> tuple[np.ndarray, np.ndarray]:
    r"""The sweep's ground truth under a mask: exact float64 softmax probabilities ``(C, N, M)``, output ``(C, N, Dv)``.

    .. math:: P_{nm} = \frac{\exp(s\, q_n \cdot k_m - c_n)}{\sum_{m' \in V_n} \exp(s\, q_n \cdot k_{m'} - c_n)}
        \ (m \in V_n), \qquad P_{nm} = 0 \ (m \notin V_n), \qquad y_n = \sum_m P_{nm} v_m,

    with :math:`V_n` the keys visible to query n under ``kind``
    (:func:`~randattn.analysis.masking.visible_keys`) and :math:`c_n` its largest visible logit (every row
    keeps its own key, so it is finite): the hidden logits are set to :math:`-\infty`, so the hidden
    probabilities are exactly 0. ``torch``: the torch module, to compute as the torch backend does
    (float64, the process's thread count); None: numpy.

    Parameters
    ----------
    kind : str
        ``"causal"`` or ``"sliding:W"``.
    q : (C, N, D) ndarray
    k : (C, M, D) ndarray
    v : (C, M, Dv) ndarray
    scale : float
        The logit temperature s.
    torch : module, optional
    """
    visible = visible_keys(kind, q.shape[-2], k.shape[-2])
    if torch is None:
        logits = np.where(visible, scale * (q @ np.swapaxes(k, -1, -2)), -np.inf)
        weights = np.exp(logits - logits.max(-1, keepdims=True))
        probs = weights / weights.sum(-1, keepdims=True)
        return probs, probs @ v
    tq, tk, tv = (torch.from_numpy(np.ascontiguousarray(a, dtype=np.float64)) for a in (q, k, v))
    logits = (scale * (tq @ tk.transpose(-1, -2))).masked_fill_(~torch.from_numpy(visible), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return probs.numpy(), (probs @ tv).numpy()


def _lap(seconds: dict[str, float], phase: str, mark: float, clock: Callable[[], float]) -> float:
    """Adds the time since ``mark`` to ``seconds[phase]``; returns now, the next phase's mark."""
    now = clock()
    seconds[phase] += now - mark
    return now


def _slice_draws(draws: Draws, reps: slice, cells: slice) -> Draws:
    arrays = {key: a[reps, cells] for key, a in draws.arrays.items()}
    return Draws(arrays, len(range(draws.replicates)[reps]))


def _draw_bytes(draws: Draws) -> int:
    return sum(a.nbytes for a in draws.arrays.values())


def _row_errors(probs, exact):
    """float64 ``|P_hat_n - P_n|`` per row ``(R, C, N)``, overwriting ``probs`` (the run's dtype, no float64 copy).

    The exact P rounded to float32 is off by <= 6e-8 P, negligible against an estimator's |P_hat - P|. Each row's
    norm is taken in the run's dtype (each row alone, whatever the block); sum(dtype=float64) over the block would
    convert it whole (20x slower).
    """
    import torch

    return torch.linalg.vector_norm(probs.sub_(exact), dim=-1).to(torch.float64)  # one fused pass; rounding ~1e-8


def probability_rounding_negligible(row_err, bound, exact_norms, rtol: float) -> bool:
    r"""Whether rounding moves every (replicate, cell)'s probability squared error by at most ``rtol`` of it.

    ``row_err (R, C, N)`` are the computed :math:`\tilde e_n = \|\tilde P_n - \mathrm{fl_{32}}(P_n)\|_2`,
    ``bound (R, C, N)`` bounds :math:`\|\tilde P_n - \hat P_n\|_2` (the estimator's product rounding) and
    ``exact_norms (C, N)`` are :math:`\|\mathrm{fl_{32}}(P_n)\|_2`. With
    :math:`\delta_n = b_n + 1.01\,u \|P_n\|_2` (also the exact probabilities' rounding to float32,
    :math:`u = 2^{-24}`), the exact :math:`e_n = \|\hat P_n - P_n\|_2` lies within :math:`\delta_n` of
    :math:`\tilde e_n`, so :math:`|\sum_n \tilde e_n^2 - \sum_n e_n^2| \le \sum_n \delta_n (2 \tilde e_n + \delta_n)`
    and :math:`\sum_n e_n^2 \ge \sum_n \max(\tilde e_n - \delta_n, 0)^2`; the test is that the first is at most
    ``rtol`` times the second. The float32 difference and norm round relative to :math:`\tilde e_n` only, as in
    every float32 run. A NaN or inf anywhere fails the test.
    """
    delta = bound + 1.01 * 2.0**-24 * exact_norms.to(bound.dtype)
    change = (delta * (2.0 * row_err + delta)).sum(-1)
    floor = (row_err - delta).clamp(min=0.0).square().sum(-1)
    return bool((change <= rtol * floor).all())


class UnitRunner:
    """Evaluates units of one sweep over one activation set; holds per-run caches (not global state).

    Parameters
    ----------
    acts : Activations
    config : SweepConfig
    """

    def __init__(self, acts, config: SweepConfig) -> None:
        from randattn.estimators.registry import get_spec

        self.acts = acts
        self.config = config
        self.scale = acts.scale
        self.specs = {e.name: get_spec(e.name) for e in config.estimators}
        self._cell_bytes: dict[tuple, int] = {}
        # the inputs and exact attention of the last (layer, image, heads), with its probabilities per run dtype:
        # the plan runs the units of one (layer, image) consecutively (17 units per image-layer in W1)
        self._last_inputs: tuple[tuple, tuple, dict] | None = None
        self.torch = None
        if config.backend == "torch":
            import torch

            self.torch = torch
            self.device = torch.device(config.device) if config.device is not None else torch.device("cpu")

    # ------------------------------------------------------------------------------------------------ inputs
    def inputs(self, unit: Unit) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """float64 ``q, k, v : (C, N, D)`` of the unit's heads.

        Taken through :meth:`~randattn.activations.io.Activations.layer_qkv` so that a grouped-query file's shared
        keys and values are gathered for the unit's heads of one image only, never expanded to the whole layer.
        """
        q, k, v = self.acts.layer_qkv(unit.layer, heads=list(unit.heads), image=unit.image)
        return q.astype(np.float64), k.astype(np.float64), v.astype(np.float64)

    def mask(self, unit: Unit) -> str | None:
        """The mask kind of ``unit``'s layer (:meth:`~randattn.analysis.plan.SweepConfig.mask_of`)."""
        return self.config.mask_of(unit.layer)

    def exact(self, unit: Unit, q, k, v) -> tuple[np.ndarray, np.ndarray]:
        r"""Exact float64 softmax probabilities ``(C, N, M)`` and output ``(C, N, Dv)``.

        On the torch backend they are computed by torch in float64 with the sweep's pinned thread
        count, so that every process (a Dask worker too) gets the same bits; numpy's BLAS takes its
        thread count from the environment, which a Dask nanny sets on its own.

        Under a mask (:meth:`mask`) the softmax runs over the visible keys only
        (:func:`~randattn.analysis.masking.visible_keys`): the hidden logits are set to
        :math:`-\infty`, so the hidden probabilities are exactly 0,
        :math:`P_{nm} = \exp(s\, q_n \cdot k_m) / \sum_{m' \in V_n} \exp(s\, q_n \cdot k_{m'})` for
        :math:`m \in V_n`.
        """
        kind = self.mask(unit)
        if kind is not None:
            return exact_under_mask(kind, q, k, v, self.scale, torch=self.torch)
        if self.torch is None:
            from randattn.estimators.softmax.reference import attention_probabilities

            probs = attention_probabilities(q, k, scale=self.scale)
            return probs, probs @ v
        torch = self.torch
        tq, tk, tv = (torch.from_numpy(np.ascontiguousarray(a)) for a in (q, k, v))
        probs = torch.softmax(self.scale * (tq @ tk.transpose(-1, -2)), dim=-1)
        return probs.numpy(), (probs @ tv).numpy()

    def _inputs_and_exact(self, unit: Unit, dtype_name: str):
        """``(q, k, v, exact_probs, exact)`` of the unit's heads; probabilities as a run-dtype tensor on torch.

        Cached for the last (layer, image, heads) only, so it holds one image-layer's arrays at most.
        """
        key = (unit.layer, unit.image, tuple(unit.heads))
        if self._last_inputs is None or self._last_inputs[0] != key:
            q, k, v = self.inputs(unit)
            self._last_inputs = (key, (q, k, v, *self.exact(unit, q, k, v)), {})
        _, (q, k, v, exact_probs, exact), converted = self._last_inputs
        if self.torch is not None and self.config.probabilities:
            if dtype_name not in converted:
                converted[dtype_name] = self.torch.as_tensor(exact_probs, device=self.device,
                                                             dtype=getattr(self.torch, dtype_name))
            exact_probs = converted[dtype_name]
        return q, k, v, exact_probs, exact

    def _exact_sq_norms(self, unit: Unit):
        """The exact probabilities' squared row norms ``||P_n||^2 (C, N)``, float64 on the device (cached as above)."""
        self._inputs_and_exact(unit, "float64")
        converted = self._last_inputs[2]
        if "sq_norms" not in converted:
            probs = self._last_inputs[1][3]
            converted["sq_norms"] = self.torch.as_tensor(np.einsum("...m,...m->...", probs, probs), device=self.device)
        return converted["sq_norms"]

    def _sink_mass(self, unit: Unit) -> np.ndarray:
        """float64 ``(C,)``: each cell's exact attention probability on key 0, averaged over the queries.

        A language model's first token draws much of every head's attention (the attention sink); the column
        says how much, so a reader can relate an estimator's error to it. Cached with the exact attention.
        """
        self._inputs_and_exact(unit, "float64")
        converted = self._last_inputs[2]
        if "sink" not in converted:
            converted["sink"] = np.asarray(self._last_inputs[1][3][..., 0], dtype=np.float64).mean(-1)
        return converted["sink"]

    def _exact_output(self, unit: Unit):
        """The exact output ``(C, N, Dv)`` as a float64 tensor on the device (cached as above)."""
        self._inputs_and_exact(unit, "float64")
        converted = self._last_inputs[2]
        if "output" not in converted:
            converted["output"] = self.torch.as_tensor(self._last_inputs[1][4], device=self.device)
        return converted["output"]

    def _dtype_name(self, est: EstimatorConfig) -> str:
        return "float64" if self.config.backend == "reference" else est.torch_dtype_name(self.config.dtype)

    # ------------------------------------------------------------------------------------------------ memory
    def cell_bytes(self, unit: Unit) -> int:
        """Approximate peak bytes of the smallest block of ``unit``: one (cell, replicate)."""
        return self.block_bytes(unit, 1, 1)

    def block_bytes(self, unit: Unit, cells: int, reps: int) -> int:
        """Approximate peak bytes of a block of ``cells`` heads x ``reps`` replicates of ``unit``.

        The working set is modelled as ``cells * (a + b * reps)``: ``a`` is what a cell needs
        whatever R (EVA's exact chunk weights, the exact probabilities, gathered keys), ``b``
        what each replicate adds. Both are measured at one cell with one and two replicates.
        """
        per_cell, per_rep = self._calibration(unit)
        return cells * (per_cell + per_rep * reps)

    def _calibration(self, unit: Unit) -> tuple[int, int]:
        """``(a, b)`` of :meth:`block_bytes` for ``unit``'s configuration, S and shape (measured once)."""
        est = self.config.estimators[unit.est_index]
        n, d = self.acts.shape[2], self.acts.shape[3]
        kind = self.mask(unit)
        key = (est.label, unit.num_samples, self.acts.shape[2:], kind)  # a masked estimator may take another path
        if key not in self._cell_bytes:
            spec = self.specs[est.name]
            q, k, v = (a[:1] for a in self.inputs(unit))
            exact_probs = self.exact(unit, q, k, v)[0] if self.config.probabilities else None
            reps_measured = (1, 2) if est.random else (1,)

            def peak_at(samples: int | None, reps: int) -> int:
                draws = cell_draws(spec, est, q.shape[1:], k.shape[1:], [0], range(reps), samples, kind)

                def one() -> None:
                    # the code path that runs: estimates, the probability pass, diagnostics
                    self._estimate_block(spec, est, q, k, v, draws, exact_probs, full_precision=True, mask=kind)
                    if self.config.diagnostics and est.random:
                        self._diagnostics_block(est, q, k, v, draws, first_block=False, mask=kind)

                from randattn._precision import full_precision_matmul

                with warnings.catch_warnings(), full_precision_matmul():  # the code path and precision of the run
                    warnings.simplefilter("ignore")  # calibration only: the real run reports warnings
                    return measure_peak(one, torch_tensors=self.torch is not None) + _draw_bytes(draws)

            def model_at(samples: int | None) -> tuple[int, int]:
                peaks = [peak_at(samples, r) for r in reps_measured]
                per_rep = max(peaks[-1] - peaks[0], 0) if len(peaks) > 1 else peaks[0]
                return max(peaks[0] - per_rep, 0), per_rep

            s = unit.num_samples
            peak_at(min(s, _CALIBRATION_SAMPLES[0]) if s is not None else None, 1)  # warm-up: caches, lazy imports
            if s is None or s <= _CALIBRATION_SAMPLES[1]:
                a, b = model_at(s)
            else:  # affine in S through the two calibration points
                (s1, s2) = _CALIBRATION_SAMPLES
                (a1, b1), (a2, b2) = model_at(s1), model_at(s2)
                a = int(max(a1, a2) + max(a2 - a1, 0) / (s2 - s1) * (s - s2))
                b = int(max(b1, b2) + max(b2 - b1, 0) / (s2 - s1) * (s - s2))
            # margin 1.5 for allocator slack; stored per (cell, replicate): the float64 estimate
            self._cell_bytes[key] = (int(1.5 * a), int(1.5 * b) + 8 * n * v.shape[-1] + 8 * (s or 1) * d)
        return self._cell_bytes[key]

    def blocks(self, unit: Unit) -> list[tuple[slice, slice]]:
        """(cells, replicates) blocks of ``unit`` under ``max_memory``.

        Blocks are canonical -- every head of the unit and :data:`CANONICAL_REPLICATES`
        replicates -- whenever the budget holds one such block: the estimators' BLAS calls then
        see the same shapes whatever the budget, so rows are bitwise identical across budgets
        (a batched matmul's rounding may depend on its batch size). Smaller budgets split
        further, which can change results in the last bit.

        Raises
        ------
        MemoryBudgetError
            One (cell, replicate) alone exceeds the budget.
        """
        est = self.config.estimators[unit.est_index]
        cells, reps = len(unit.heads), self.replicates(est)
        budget = self.config.max_memory
        per = self.cell_bytes(unit)
        if per > budget:
            s = "" if unit.num_samples is None else f" at S = {unit.num_samples}"
            raise MemoryBudgetError(
                f"one replicate of one head of {est.label}{s} with {self.acts.shape[2]} tokens needs about "
                f"{format_bytes(per)}, more than the memory budget of {format_bytes(budget)}; "
                "raise --max-memory or use fewer --samples"
            )
        per_cell, per_rep = self._calibration(unit)

        def most_reps(c: int) -> int:  # the most replicates a block of c cells holds within the budget
            return (budget // c - per_cell) // per_rep if per_rep else reps

        canonical = min(CANONICAL_REPLICATES, reps)
        if self.block_bytes(unit, cells, canonical) <= budget:
            size = canonical
        elif self.block_bytes(unit, cells, 1) <= budget:
            size = most_reps(cells)
        else:
            size = max(1, most_reps(1))
            return [(slice(c, c + 1), slice(r, min(r + size, reps))) for c in range(cells)
                    for r in range(0, reps, size)]
        return [(slice(0, cells), slice(r, min(r + size, reps))) for r in range(0, reps, size)]

    def replicates(self, est: EstimatorConfig) -> int:
        return self.config.replicates if est.random else 1

    # ------------------------------------------------------------------------------------------------ estimation
    def _estimate_block(self, spec, est: EstimatorConfig, q, k, v, draws: Draws, exact_probs, exact_probs32=None,
                        *, full_precision: bool = False, rank: int | None = None, exact_sq_norms=None, exact64=None,
                        mask: str | None = None):
        """Estimates ``(R_b, C_b, N, Dv)`` and the probabilities' squared error ``(R_b, C_b)``.

        The estimates stay as computed (a torch tensor in the run's dtype on its device, or the
        reference's float64 array): :meth:`_run` writes them, or on the torch backend their
        differences from the exact output, into the unit's float64 array.
        Where the estimator's probabilities have low rank (``rank``: the unit's S, see
        :func:`~randattn.analysis.probability_error.factored_pays`), their error is measured from
        the factors when the rounding bound allows (:data:`PROBABILITY_ROUNDING_RTOL`); else a
        float64 run under ``dtype="auto"`` takes the estimator's float32 probability product
        where one exists and its bound allows; ``full_precision`` forces the dense float64
        product (the calibration measures that, the larger working set). ``exact_probs32``: the
        exact probabilities in float32, ``exact_sq_norms`` their squared row norms (float64) and
        ``exact64`` a callable giving them as a float64 tensor, if at hand. ``mask``: the layer's
        mask kind, passed to every estimator call when set (a form that returns None for it, as
        the probability factors of a causal estimator may, is taken as absent).
        """
        masked = estimator_mask_kwargs(mask)
        if (not full_precision and exact_sq_norms is not None and exact64 is not None
                and self._factors_pay(spec, est, rank, q.shape[-2])):
            factored = self._factored_probability_block(spec, est, q, k, v, draws, exact_probs32, exact_sq_norms,
                                                        exact64, mask=mask)
            if factored is not None:
                return factored
        if not full_precision and self._rounds_probabilities(spec, est):
            rounded = self._float32_probability_block(spec, est, q, k, v, draws,
                                                      exact_probs if exact_probs32 is None else exact_probs32,
                                                      mask=mask)
            if rounded is not None:
                return rounded
        m = k.shape[-2]
        if self.torch is None:
            out = np.asarray(spec.reference(q, k, v, draws, scale=self.scale, **est.params, **masked),
                             dtype=np.float64)
            prob_sq = None
            if self.config.probabilities:
                eye = np.broadcast_to(np.eye(m), (*k.shape[:-1], m))
                probs = np.asarray(spec.reference(q, k, eye, draws, scale=self.scale, **est.params, **masked),
                                   dtype=np.float64)
                prob_sq = ((probs - exact_probs) ** 2).sum(axis=(-2, -1))
            return out, prob_sq
        torch = self.torch
        dt = getattr(torch, self._dtype_name(est))
        tq, tk, tv = (torch.as_tensor(a, device=self.device, dtype=dt) for a in (q, k, v))
        tdraws = draws.to_torch(device=self.device, dtype=dt)
        with torch.no_grad():
            prob_sq = None
            if not self.config.probabilities:
                out = spec.batched(tq, tk, tv, tdraws, scale=self.scale, **est.params, **masked)
            elif spec.batched_with_probabilities is not None:
                # one pass: the features and weights the two results share are computed once (same bits as two calls)
                out, probs = spec.batched_with_probabilities(tq, tk, tv, tdraws, scale=self.scale, **est.params,
                                                             **masked)
            else:
                out = spec.batched(tq, tk, tv, tdraws, scale=self.scale, **est.params, **masked)
                if spec.batched_probabilities is not None:
                    probs = spec.batched_probabilities(tq, tk, tdraws, scale=self.scale, **est.params, **masked)
                else:
                    eye = torch.eye(m, device=self.device, dtype=dt).expand(*k.shape[:-1], m)
                    probs = spec.batched(tq, tk, eye, tdraws, scale=self.scale, **est.params, **masked)
            if self.config.probabilities:
                # in place in the run's dtype; the N squared row norms summed in float64
                prob_sq = _row_errors(probs, torch.as_tensor(exact_probs, device=self.device, dtype=probs.dtype))
                prob_sq = prob_sq.square_().sum(-1).cpu().numpy()
                del probs
        return out, prob_sq

    def _rounds_probabilities(self, spec, est: EstimatorConfig) -> bool:
        """Whether this run may take ``spec``'s float32 probability product (a float64 run under ``dtype="auto"``)."""
        return (self.torch is not None and self.config.probabilities and self.config.dtype == "auto"
                and self._dtype_name(est) == "float64" and spec.batched_with_float32_probabilities is not None)

    def _factors_pay(self, spec, est: EstimatorConfig, rank: int | None, queries: int) -> bool:
        """Whether this block measures the probability error from the estimator's factors.

        On the torch backend, with probabilities, where the estimator has factors and they are
        the faster way (:func:`~randattn.analysis.probability_error.factored_pays`), in float32
        runs and in float64 runs under ``dtype="auto"`` (an explicit float64 run stays float64).
        """
        if (self.torch is None or not self.config.probabilities or spec.batched_with_probability_factors is None
                or not factored_pays(rank, queries)):
            return False
        return self._dtype_name(est) == "float32" or self.config.dtype == "auto"

    def _factored_probability_block(self, spec, est: EstimatorConfig, q, k, v, draws: Draws, exact32, sq_norms,
                                    exact64, mask: str | None = None):
        """:meth:`_estimate_block` through the probabilities' factors, or None where they have none or the bound is loose.

        The error is taken in float32 where its bound allows, else from the same factors in float64
        (``exact64``: a callable giving the exact probabilities as a float64 tensor), else None.
        """
        torch = self.torch
        dt = getattr(torch, self._dtype_name(est))
        tq, tk, tv = (torch.as_tensor(a, device=self.device, dtype=dt) for a in (q, k, v))
        with torch.no_grad():
            result = spec.batched_with_probability_factors(tq, tk, tv, draws.to_torch(device=self.device, dtype=dt),
                                                           scale=self.scale, **est.params,
                                                           **estimator_mask_kwargs(mask))
            if result is None:  # no factors for this variant (e.g. under a causal mask)
                return None
            out, left, right = result
            sq, bound = factored_sq_errors(left.to(torch.float32), right.to(torch.float32),
                                           torch.as_tensor(exact32, device=self.device, dtype=torch.float32), sq_norms)
            if not factored_rounding_negligible(sq, bound, PROBABILITY_ROUNDING_RTOL):
                # errors too small for float32's bound: the same factors in float64 cost about the dense pass
                sq, bound = factored_sq_errors(left.to(torch.float64), right.to(torch.float64), exact64(), sq_norms)
                if not factored_rounding_negligible(sq, bound, PROBABILITY_ROUNDING_RTOL):
                    return None
        return out, sq.cpu().numpy()

    def _float32_probability_block(self, spec, est: EstimatorConfig, q, k, v, draws: Draws, exact_probs,
                                   mask: str | None = None):
        """:meth:`_estimate_block` through the float32 probability product, or None where its bound is too loose."""
        torch = self.torch
        tq, tk, tv = (torch.as_tensor(a, device=self.device, dtype=torch.float64) for a in (q, k, v))
        with torch.no_grad():
            result = spec.batched_with_float32_probabilities(
                tq, tk, tv, draws.to_torch(device=self.device, dtype=torch.float64), scale=self.scale, **est.params,
                **estimator_mask_kwargs(mask))
            if result is None:  # no float32 product for this variant
                return None
            out, probs, bound = result
            exact32 = torch.as_tensor(exact_probs, device=self.device, dtype=torch.float32)
            row_err = _row_errors(probs, exact32)
            del probs
            if not probability_rounding_negligible(row_err, bound, torch.linalg.vector_norm(exact32, dim=-1),
                                                   PROBABILITY_ROUNDING_RTOL):
                return None
        return out, row_err.square_().sum(-1).cpu().numpy()

    def _diagnostics_block(self, est: EstimatorConfig, q, k, v, draws: Draws, first_block: bool,
                           mask: str | None = None):
        """Per (replicate, cell) ESS and delta-method variance ``(R_b, C_b)``, and k-hat ``(C_b,)`` or None.

        None under a mask the spec's importance-weight provider does not take
        (:func:`~randattn.analysis.masking.diagnostics_skip_reason`): bidirectional weights would
        describe another estimator.
        """
        from randattn.analysis.diagnostics import replicate_snis_diagnostics

        if diagnostics_skip_reason(self.specs[est.name], est.params, mask, self.config.backend) is not None:
            return None
        return replicate_snis_diagnostics(
            est.name, q, k, v, draws, scale=self.scale, params=est.params,
            khat_queries=self.config.khat_queries if first_block else 0,
            backend=self.config.backend, device=None if self.torch is None else self.device,
            dtype=self._dtype_name(est), mask=mask,
        )

    def _reference_deviation(self, spec, est: EstimatorConfig, q, k, v, draws: Draws, batched_first,
                             mask: str | None = None) -> float:
        """max |batched - reference| on the unit's first cell and replicate (same draws, same mask).

        ``batched_first (N, Dv)``: the batched estimate of that cell and replicate, a tensor in the run's dtype.
        """
        ref = spec.reference(q[:1], k[:1], v[:1], _slice_draws(draws, slice(0, 1), slice(0, 1)), scale=self.scale,
                             **est.params, **estimator_mask_kwargs(mask))
        batched = batched_first.to("cpu", self.torch.float64).numpy()
        return float(np.max(np.abs(np.asarray(ref, dtype=np.float64)[0, 0] - batched)))

    # ------------------------------------------------------------------------------------------------ a unit
    def run(self, unit: Unit) -> list[dict[str, Any]]:
        """The rows of ``unit`` (one per head and reported S), in head order.

        torch computes with ``config.threads`` intra-op threads and float32 matrix products in IEEE float32
        (:func:`randattn._precision.full_precision_matmul`; both restored afterwards), so that the rows are
        the same in every process that runs the unit and no TF32 rounding enters them.
        """
        return self.run_timed(unit).rows

    def run_timed(self, unit: Unit) -> UnitResult:
        """:class:`UnitResult`: ``run(unit)``, the wall seconds of each of the unit's :data:`PHASES`, and its
        per-position rows (None when the unit's layer gets none)."""
        if self.torch is None:
            return self._run(unit)
        from randattn._precision import full_precision_matmul

        if self.config.threads is None:
            with full_precision_matmul():
                return self._run(unit)
        before = self.torch.get_num_threads()
        self.torch.set_num_threads(self.config.threads)
        try:
            with full_precision_matmul():
                return self._run(unit)
        finally:
            self.torch.set_num_threads(before)

    def _run(self, unit: Unit) -> UnitResult:
        from randattn.analysis.metrics import metrics_of_differences, metrics_with_relative_error

        clock = time.perf_counter
        start = clock()
        seconds = dict.fromkeys(PHASES, 0.0)
        config = self.config
        est = config.estimators[unit.est_index]
        spec = self.specs[est.name]
        kind = self.mask(unit)
        blocks = self.blocks(unit)
        q, k, v, exact_probs, exact = self._inputs_and_exact(unit, self._dtype_name(est))
        factored = self._factors_pay(spec, est, unit.num_samples, q.shape[-2])
        exact32 = (self._inputs_and_exact(unit, "float32")[3]
                   if factored or self._rounds_probabilities(spec, est) else None)
        sq_norms = self._exact_sq_norms(unit) if factored else None
        seconds["exact"] = clock() - start  # the exact attention, computed by the first unit of an image-layer
        cells, reps = len(unit.heads), self.replicates(est)
        n, dv = q.shape[-2], v.shape[-1]
        if self.torch is None:
            out = np.empty((reps, cells, n, dv))  # the reference's float64 estimates
        else:
            # estimate - exact in float64 on the device: the estimates never cross to the host (issue 9, GPU-ready)
            exact_out = self._exact_output(unit)
            out = self.torch.empty((reps, cells, n, dv), dtype=self.torch.float64, device=self.device)
        prob_sq = np.full((reps, cells), np.nan)
        ess = np.full((reps, cells), np.nan)
        delta = np.full((reps, cells), np.nan)
        khat = np.full(cells, np.nan)
        diagnose = config.diagnostics and est.random
        skipped = diagnostics_skip_reason(spec, est.params, kind, config.backend) if diagnose else None
        if skipped is not None:
            warnings.warn(skipped, DiagnosticsSkippedWarning, stacklevel=2)  # NaN with its reason, once per unit
            diagnose = False
        ref_dev = np.nan
        for cs, rs in blocks:
            mark = clock()
            draws = cell_draws(spec, est, q.shape[1:], k.shape[1:], unit.seeds[cs], range(rs.start, rs.stop),
                               unit.num_samples, kind)
            mark = _lap(seconds, "draws", mark, clock)
            block_out, block_prob = self._estimate_block(spec, est, q[cs], k[cs], v[cs], draws,
                                                         exact_probs[cs] if config.probabilities else None,
                                                         None if exact32 is None else exact32[cs],
                                                         rank=unit.num_samples,
                                                         exact_sq_norms=None if sq_norms is None else sq_norms[cs],
                                                         exact64=lambda cs=cs: self._inputs_and_exact(
                                                             unit, "float64")[3][cs], mask=kind)
            if self.torch is None:
                out[rs, cs] = block_out
            else:
                # in float64 (a float32 estimate converts exactly): the value numpy's float64(est) - exact gave
                self.torch.sub(block_out, exact_out[cs], out=out[rs, cs])
            if block_prob is not None:
                prob_sq[rs, cs] = block_prob
            mark = _lap(seconds, "estimate", mark, clock)
            if diagnose and rs.start < DIAGNOSTIC_REPLICATES:
                used = slice(rs.start, min(rs.stop, DIAGNOSTIC_REPLICATES))
                diag = self._diagnostics_block(est, q[cs], k[cs], v[cs],
                                               _slice_draws(draws, slice(0, used.stop - used.start), slice(None)),
                                               rs.start == 0, mask=kind)
                if diag is not None:
                    ess[used, cs], delta[used, cs] = diag.ess, diag.delta_variance
                    if diag.khat is not None:
                        khat[cs] = diag.khat
            mark = _lap(seconds, "diagnostics", mark, clock)
            if unit.check_reference and rs.start == 0 and cs.start == 0 and self.torch is not None:
                ref_dev = self._reference_deviation(spec, est, q[cs], k[cs], v[cs], draws, block_out[0, 0], mask=kind)
            _lap(seconds, "reference_check", mark, clock)
        mark = clock()
        scheme = config.positions_of(unit.layer)
        per_bucket = None
        if scheme is not None:  # before the cell's metrics, which overwrite the differences on the torch backend
            buckets = bucket_query_slices(scheme, n, k.shape[-2])
            per_bucket = (bucket_metrics(out, exact, buckets, random=est.random, differences=False)
                          if self.torch is None else
                          bucket_metrics(out, exact_out, buckets, random=est.random, differences=True))
        if self.torch is None:
            metrics, rel = metrics_with_relative_error(out, exact, random=est.random)
        else:
            metrics, rel = metrics_of_differences(out, exact_out, random=est.random)
        prob_mse = prob_sq[: metrics.replicates].mean(0) / (n * k.shape[-2])
        with np.errstate(divide="ignore", invalid="ignore"):
            delta_ratio = delta[:DIAGNOSTIC_REPLICATES].mean(0) / metrics.variance
        ess_mean = ess[:DIAGNOSTIC_REPLICATES].mean(0)
        _lap(seconds, "metrics", mark, clock)
        per_cell = (clock() - start) / cells
        rows = []
        sink = self._sink_mass(unit)
        model = str(self.acts.metadata.get("model", "unknown"))
        dtype = self._dtype_name(est)
        mask = mask_label(kind)
        for j, h in enumerate(unit.heads):
            for s in unit.row_samples(config):
                rows.append({
                    "model": model, "image": unit.image_name, "layer": int(unit.layer), "head": int(h),
                    "tokens": int(n), "mask": mask, "estimator": est.name, "params": est.params_json,
                    "label": est.label, "num_samples": int(s), "replicates": int(metrics.replicates),
                    "random": bool(est.random),
                    "mse": metrics.mse[j], "mse_se": metrics.mse_se[j], "variance": metrics.variance[j],
                    "bias_sq": metrics.bias_sq[j], "bias_sq_naive": metrics.bias_sq_naive[j],
                    "bias_sq_se": metrics.bias_sq_se[j], "rel_error": rel[j],
                    "prob_mse": prob_mse[j] if config.probabilities else np.nan,
                    "ess_mean": ess_mean[j], "delta_var_ratio": delta_ratio[j], "pareto_khat": khat[j],
                    "dtype": dtype, "ref_max_abs_dev": ref_dev if j == 0 else np.nan,
                    "seconds": per_cell, "seed": int(unit.seeds[j]), "sink_mass": float(sink[j]),
                })
        positions = None if per_bucket is None else [
            {"model": model, "image": unit.image_name, "layer": int(unit.layer), "head": int(h), "tokens": int(n),
             "mask": mask, "estimator": est.name, "params": est.params_json, "label": est.label,
             "num_samples": int(s),
             "replicates": int(m.replicates), "random": bool(est.random), "position_lo": lo, "position_hi": hi,
             "queries": count, "mse": m.mse[j], "mse_se": m.mse_se[j], "variance": m.variance[j],
             "bias_sq": m.bias_sq[j], "bias_sq_naive": m.bias_sq_naive[j], "bias_sq_se": m.bias_sq_se[j],
             "seed": int(unit.seeds[j])}
            for j, h in enumerate(unit.heads) for s in unit.row_samples(config) for lo, hi, count, m in per_bucket
        ]
        return UnitResult(rows, seconds, positions)


def _normalise_message(message: str) -> str:
    return re.sub(r"\d+ of \d+", "some", message)


def run_recording(runner: UnitRunner, unit: Unit) -> tuple[list[dict[str, Any]], list[tuple[str, str]],
                                                           dict[str, float], list[dict[str, Any]] | None]:
    """``runner.run_timed(unit)`` with the warnings it raised, as (category, message) pairs: rows, warnings,
    seconds, per-position rows (or None).

    What every executor runs for a unit (in this process or in a Dask worker); counts in messages
    ("3 of 16 queries") are normalised so that the same warning of different units is counted as one.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows, seconds, positions = runner.run_timed(unit)
    return rows, [(w.category.__name__, _normalise_message(str(w.message))) for w in caught], seconds, positions
