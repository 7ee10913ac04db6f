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
delta-method variance -- and the blocks are joined before any reduction over replicates. A
budget that holds the canonical block (every head x every replicate) gives the same
rows, bit for bit, whatever its size (tested); a smaller one reshapes the estimators' batched
kernels, whose rounding depends on the batch's shape, so a row can move by rounding, within
:data:`~randattn.analysis.cell_memory.SPLIT_ROUNDING` (measured by a test).

Where each job lives
--------------------
:meth:`UnitRunner.run` is the orchestration; its jobs are modules of their own:

- :mod:`~randattn.analysis.exact_cache`: the inputs and exact attention, per image-layer, cached;
- :mod:`~randattn.analysis.cell_memory`: the memory model -- a block of c cells x r replicates
  needs ``c (a + b r)`` bytes, calibrated by :func:`~randattn.analysis.memory.measure_peak` on
  the code path that runs (diagnostics included) -- and the blocks a budget allows; a unit whose
  single (cell, replicate) exceeds ``max_memory`` is refused with :class:`MemoryBudgetError`
  before anything is computed;
- :mod:`~randattn.analysis.estimate_block`: the estimates and the way their probabilities'
  error is measured (factored, float32 product, dense);
- :mod:`~randattn.analysis.unit_diagnostics`: the importance-sampling diagnostics;
- :mod:`~randattn.analysis.unit_rows`: the metrics and the table's rows.
"""

from __future__ import annotations

import contextlib
import re
import time
import warnings
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import numpy as np

# MemoryBudgetError, format_bytes, exact_under_mask, COLUMNS and the two warnings are also this module's public names
# (__all__): what a caller of the unit runner meets, importable beside it
from randattn._tensors import input_tensor
from randattn.analysis.cell_memory import (
    REFERENCE_CHECK_TOKENS,
    MemoryBudgetError,
    block_bytes,
    calibration_sizes,
    extrapolate_peak,
    check_fits,
    fit_cell_model,
    format_bytes,
    measure_block_peak,
    split_blocks,
    stored_bytes,
    unit_peak_bytes,
    with_margin,
)
from randattn.analysis.estimate_block import (
    BlockEstimator,
    ProbabilitiesSkippedWarning,
    columns_skip_reason,
)
from randattn.analysis.exact_cache import ExactCache, exact_under_mask
from randattn.analysis.masking import diagnostics_skip_reason
from randattn.analysis.query_blocks import QueryBlock, blocks_queries, largest_first, timed_block_indices
from randattn.analysis.query_blocks import query_blocks as split_queries
from randattn.analysis.plan import (
    EstimatorConfig,
    StackedDrawError,
    StackedGenerators,
    SweepConfig,
    Unit,
    replicate_rng,
)
from randattn.analysis.unit_diagnostics import (
    DiagnosticsSkippedWarning,
    UnitDiagnostics,
    diagnostics_block,
)
from randattn.analysis.relative_error import denominator_relative_errors, relative_error_columns
from randattn.analysis.unit_rows import COLUMNS, keys_used_columns, output_metrics, position_rows, table_rows
from randattn.estimators.base import Draws
from randattn.estimators.masks import NO_MASK, Mask

__all__ = ["COLUMNS", "PHASES", "DiagnosticsSkippedWarning", "MemoryBudgetError", "ProbabilitiesSkippedWarning",
           "ReferenceCheck", "SeedIgnoredWarning", "UnitResult", "UnitRunner", "exact_under_mask", "format_bytes",
           "run_recording", "seed_ignored"]

#: the parts of a unit's wall time that :meth:`UnitRunner.run_timed` reports: the exact attention (the first unit of
#: an image-layer computes it), the draws, the estimates with their probability error, the importance-sampling
#: diagnostics, the float64-reference spot check, and the metrics with the rows; on a GPU each phase ends at the host
#: transfer of its small results, so its time includes the device work queued before it
PHASES: tuple[str, ...] = ("exact", "draws", "estimate", "diagnostics", "reference_check", "metrics")


class SeedIgnoredWarning(UserWarning):
    """A configuration declared random drew the same random variables for two replicates of one cell: its ``draw``
    ignores the generator it is given, so its rows measure one draw R times (variance 0, the MSE a single draw's
    error); ``randattn check`` names the fault (its seeded-reproducibility check)."""


def seed_ignored(draws: Draws) -> bool:
    """Whether replicates 0 and 1 of ``draws`` are the same, bit for bit, in every array (False for fewer than two
    replicates or no arrays): each replicate is drawn from a generator of its own (:func:`replicate_rng`), so two
    equal draws of non-empty arrays mean a ``draw`` that does not read its ``rng``."""
    arrays = [np.asarray(a) for a in draws.arrays.values()]
    if draws.replicates < 2 or not arrays or not any(a[0].size for a in arrays):
        return False
    return all(np.array_equal(a[0], a[1]) for a in arrays)


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


def cell_draws(spec, config: EstimatorConfig, q_shape, k_shape, seeds: Sequence[int], reps: range, num_samples,
               mask: Mask = NO_MASK, query_block: int | None = None) -> Draws:
    """Draws ``(len(reps), C, ...)`` for the cells with these seeds; replicate r of a cell from ``replicate_rng(seed, r)``
    (``replicate_rng(seed, r, query_block)`` for a block of its queries, :mod:`~randattn.analysis.query_blocks`).

    Where the spec declares ``stacked_draw``, one ``draw`` call for the whole block, on a (replicates,
    cells) grid of generators (:class:`~randattn.analysis.plan.StackedGenerators`): the same bits as one
    call per (cell, replicate), at a fraction of the per-call cost (orthogonal features take one stacked
    QR instead of one per call). Otherwise that call per (cell, replicate), with the numpy ``Generator``
    the estimator protocol promises (:func:`per_cell_draws`). ``mask``'s keywords reach ``draw`` (none for
    no mask).
    """
    if not spec.stacked_draw:
        return per_cell_draws(spec, config, q_shape, k_shape, seeds, reps, num_samples, mask, query_block)
    generators = StackedGenerators([[replicate_rng(seed, r, query_block) for seed in seeds] for r in reps])
    cells = len(seeds)
    try:
        return spec.draw((cells, *q_shape), (cells, *k_shape), num_samples=num_samples, replicates=len(reps),
                         rng=generators, **config.params, **mask.estimator_kwargs)
    except StackedDrawError as exc:
        raise StackedDrawError(f"estimator {config.label!r}: {exc}") from None


def per_cell_draws(spec, config: EstimatorConfig, q_shape, k_shape, seeds: Sequence[int], reps: range, num_samples,
                   mask: Mask = NO_MASK, query_block: int | None = None) -> Draws:
    """:func:`cell_draws` made one ``draw(q_shape, k_shape, replicates=1, rng=replicate_rng(seed, r))`` call per
    cell and replicate, the arrays stacked to ``(len(reps), C, ...)``.

    Raises
    ------
    ValueError
        Naming the estimator, where the calls' arrays do not stack: an array without the leading replicate dim
        of 1, or with another name or shape than the first call's.
    """
    calls = [[spec.draw(q_shape, k_shape, num_samples=num_samples, replicates=1,
                        rng=replicate_rng(seed, r, query_block), **config.params, **mask.estimator_kwargs)
              for seed in seeds] for r in reps]
    first = {key: np.shape(a) for key, a in calls[0][0].arrays.items()}
    for key, shape in first.items():
        if shape[:1] != (1,):
            raise ValueError(f"estimator {config.label!r}: draw(replicates=1) gave {key!r} of shape {shape}, which "
                             "does not start with the replicate dim 1 (every array of Draws starts with "
                             "(replicates, *batch dims))")
    for row in calls:
        for one in row:
            shapes = {key: np.shape(a) for key, a in one.arrays.items()}
            if shapes != first:
                raise ValueError(f"estimator {config.label!r}: draw() gave arrays {shapes} for one cell and "
                                 f"{first} for another of the same shape; the draws of a configuration must not "
                                 "change shape from one seed to the next")
    arrays = {key: np.stack([np.stack([np.asarray(one.arrays[key])[0] for one in row]) for row in calls])
              for key in first}
    return Draws(arrays, len(reps))


def max_abs_deviation(reference: np.ndarray, batched: np.ndarray) -> float:
    """``max |batched - reference|``, where an entry that is non-finite in one form and not the same in the other is
    an infinite deviation: a NaN the batched form returns fails the spot check rather than reading as "not checked"
    (the table's NaN). Entries equal in both (NaN in both included) deviate by 0."""
    return float(_deviations(reference, batched).max(initial=0.0))


def _deviations(reference: np.ndarray, batched: np.ndarray) -> np.ndarray:
    """``|batched - reference|`` entrywise: 0 where the two are the same (NaN in both included), inf where an entry is
    non-finite in one form and not the same in the other."""
    same = (reference == batched) | (np.isnan(reference) & np.isnan(batched))
    with np.errstate(invalid="ignore"):
        deviation = np.where(same, 0.0, np.abs(reference - batched))
    return np.nan_to_num(deviation, nan=np.inf, posinf=np.inf)


@contextlib.contextmanager
def raised_while(what: str, unit: Unit) -> Iterator[None]:
    """Adds a note to any exception raised inside -- ``randattn: raised while <what> (S = ..., layer ..., heads ...,
    image ...)`` -- so that a traceback from a plugin's code says which configuration and unit it came from. The
    exception itself, its type and its message are unchanged (a typed error is still worded by its type)."""
    try:
        yield
    except Exception as exc:
        if not any(note.startswith("randattn: raised while") for note in getattr(exc, "__notes__", ())):  # innermost
            _add_note(exc, f"randattn: raised while {what} (S = {unit.num_samples}, layer {unit.layer}, heads "
                           f"{list(unit.heads)}, image {unit.image_name})")
        raise


def _add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)`` (PEP 678, Python 3.11); on Python 3.10, which has no ``add_note``, the note is kept in
    ``__notes__`` all the same (its tracebacks do not print it): an ``AttributeError`` there replaced the error."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:
        exc.__notes__ = [*getattr(exc, "__notes__", ()), note]


class ReferenceCheck(NamedTuple):
    """The spot check of one unit's first cell and replicate against the float64 reference (same draws, same mask).

    ``deviation``: ``max |batched - reference|`` (:func:`max_abs_deviation`); ``reference_error``: the reference's
    own ``max |reference - exact| / max |exact|`` against exact softmax, at or below 1e-10 where the estimator is
    exact in that cell (its RMSE is then rounding, and no ratio to it means anything); ``rms_deviation``: the root
    mean square of ``batched - reference`` over the cell's entries (:func:`rms_deviation`), what moves the cell's
    MSE; NaN where nothing was checked."""

    deviation: float = np.nan
    reference_error: float = np.nan
    rms_deviation: float = np.nan


def rms_deviation(reference: np.ndarray, batched: np.ndarray) -> float:
    r"""``sqrt(mean((batched - reference)^2))`` over every entry; inf where an entry is non-finite in one form and
    not the same in the other (as :func:`max_abs_deviation`).

    A rounding difference :math:`d` moves a squared error :math:`|e|^2` averaged over the same entries by at most
    :math:`2\,\mathrm{rms}(d)\,\mathrm{rms}(e) + \mathrm{rms}(d)^2` (Cauchy-Schwarz), so this over the RMSE bounds
    the relative move of the MSE; the largest entry alone would bound it only as well as one entry stands for all.
    """
    deviation = _deviations(reference, batched)
    if not np.isfinite(deviation).all():
        return float("inf")
    return float(np.sqrt(np.mean(deviation * deviation))) if deviation.size else 0.0


def relative_max_error(estimate: np.ndarray, exact: np.ndarray) -> float:
    """``max |estimate - exact| / max |exact|``: inf where the estimate is not finite, NaN where exact is all 0."""
    scale = float(np.abs(exact).max(initial=0.0))
    if not np.isfinite(estimate).all():
        return float("inf")
    return float(np.abs(estimate - exact).max(initial=0.0)) / scale if scale > 0 else float("nan")


def _lap(seconds: dict[str, float], phase: str, mark: float, clock: Callable[[], float]) -> float:
    """Adds the time since ``mark`` to ``seconds[phase]``; returns now, the next phase's mark."""
    now = clock()
    seconds[phase] += now - mark
    return now


def _slice_draws(draws: Draws, reps: slice, cells: slice) -> Draws:
    arrays = {key: a[reps, cells] for key, a in draws.arrays.items()}
    return Draws(arrays, len(range(draws.replicates)[reps]))


class UnitRunner:
    """Evaluates units of one sweep over one activation set; holds per-run caches (not global state).

    The jobs of a unit live in their own modules: the exact attention, cached per image-layer
    (:mod:`~randattn.analysis.exact_cache`); the memory model and its calibration
    (:mod:`~randattn.analysis.cell_memory`); the estimates with their probabilities' error
    (:mod:`~randattn.analysis.estimate_block`); the IS diagnostics
    (:mod:`~randattn.analysis.unit_diagnostics`); the metrics and rows
    (:mod:`~randattn.analysis.unit_rows`). :meth:`run` orchestrates them.

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
        self._cell_bytes: dict[tuple, tuple[int, int]] = {}
        self.torch = None
        self.device = None
        if config.backend == "torch":
            import torch

            self.torch = torch
            self.device = torch.device(config.device) if config.device is not None else torch.device("cpu")
        #: N, the query rows of the activations, and the rows measured (None: all; :mod:`randattn.analysis.queries`)
        self.num_queries = int(acts.shape[2])
        self.query_rows = config.query_rows(self.num_queries)
        self.exact_cache = ExactCache(acts, config.layer_mask, self.scale, config.probabilities, torch=self.torch,
                                      device=self.device, rows=self.query_rows)
        self.estimator = BlockEstimator(self.scale, config.probabilities, config.dtype, torch=self.torch,
                                        device=self.device)

    # ------------------------------------------------------------------------------------------------ inputs
    @property
    def measured_queries(self) -> int:
        """K, the query rows each cell measures (N unless the run selects fewer)."""
        return self.num_queries if self.query_rows is None else len(self.query_rows)

    def inputs(self, unit: Unit) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``q : (C, K, D)`` (the measured rows), ``k, v : (C, M, D)`` of the unit's heads (float64 on the reference
        backend, the file's dtype on torch: :meth:`~randattn.analysis.exact_cache.ExactCache.inputs`)."""
        return self.exact_cache.inputs(unit)

    def mask(self, unit: Unit) -> Mask:
        """The mask of ``unit``'s layer (:meth:`~randattn.analysis.plan.SweepConfig.layer_mask`)."""
        return self.config.layer_mask(unit.layer)

    def exact(self, unit: Unit, q, k, v) -> tuple[np.ndarray, np.ndarray]:
        """Exact float64 softmax probabilities ``(C, N, M)`` and output ``(C, N, Dv)`` under ``unit``'s mask
        (:func:`~randattn.analysis.exact_cache.exact_attention`)."""
        return self.exact_cache.exact(unit, q, k, v)

    def _dtype_name(self, est: EstimatorConfig) -> str:
        return self.estimator.dtype_name(est)

    # ------------------------------------------------------------------------------------------------ memory
    def cell_bytes(self, unit: Unit) -> int:
        """Approximate peak bytes of the smallest block of ``unit``: one (cell, replicate)."""
        return self.block_bytes(unit, 1, 1)

    def block_bytes(self, unit: Unit, cells: int, reps: int) -> int:
        """Approximate peak bytes of ``unit`` run in blocks of ``cells`` heads x ``reps`` replicates.

        A block's working set is modelled as ``cells * (a + b * reps)``: ``a`` is what a cell needs
        whatever R (EVA's exact chunk weights, the exact probabilities, gathered keys), ``b``
        what each replicate adds. Both are measured at one cell with one and two replicates
        (:mod:`~randattn.analysis.cell_memory`). On top comes what the unit holds across its
        blocks, its estimates of every replicate and head (:meth:`stored_bytes`), and the metrics'
        temporaries after the last block (:func:`~randattn.analysis.cell_memory.unit_peak_bytes`).
        """
        return unit_peak_bytes(block_bytes(*self._calibration(unit), cells, reps), self.stored_bytes(unit))

    def stored_bytes(self, unit: Unit) -> int:
        """Bytes of ``unit``'s float64 estimates ``(R, C, K, Dv)`` (K measured queries), kept from its first block to
        its metrics."""
        est = self.config.estimators[unit.est_index]
        return stored_bytes(len(unit.heads), self.replicates(est), self.measured_queries, self.value_dim)

    @property
    def value_dim(self) -> int:
        """Dv of the activations (the values' last axis)."""
        return int(self.acts.arrays[self.acts.layers[0]][2].shape[-1])

    def _calibration(self, unit: Unit) -> tuple[int, int]:
        """``(a, b)`` of :meth:`block_bytes` for ``unit``'s configuration, S and shape (measured once)."""
        with raised_while(f"calibrating the memory of {self.config.estimators[unit.est_index].label}", unit):
            return self._measured_calibration(unit)

    def _measured_calibration(self, unit: Unit) -> tuple[int, int]:
        est = self.config.estimators[unit.est_index]
        mask = self.mask(unit)
        key = (est.label, unit.num_samples, self.acts.shape[2:], mask)  # a masked estimator may take another path
        if key not in self._cell_bytes and self.exact_cache.tiled(unit):
            self._cell_bytes[key] = self._sliced_calibration(unit)
        if key not in self._cell_bytes:
            spec = self.specs[est.name]
            q, k, v = (a[:1] for a in self.inputs(unit))
            exact_probs = self.exact(unit, q, k, v)[0] if self.config.probabilities else None

            def peak_at(samples: int | None, reps: int) -> int:
                # the estimates with the probability pass (dense: the larger working set)
                return self._block_peak(est, q, k, v, samples, reps, mask, lambda draws: self.estimator.estimate(
                    spec, est, q, k, v, draws, exact_probs, full_precision=True, mask=mask))

            a, b = fit_cell_model(peak_at, unit.num_samples, est.random,
                                  self._accepts(est, q.shape[1:], k.shape[1:], mask))
            self._cell_bytes[key] = with_margin(a, b, queries=self.measured_queries, value_dim=v.shape[-1],
                                                key_dim=self.acts.shape[3], num_samples=unit.num_samples)
        return self._cell_bytes[key]

    def _accepts(self, est: EstimatorConfig, q_shape, k_shape, mask: Mask) -> Callable[[int], bool]:
        """``S -> bool``: whether the configuration's ``draw`` takes S on these shapes (a calibration S the user did
        not choose, :func:`~randattn.analysis.cell_memory.calibration_samples`; the unit's own S was checked by the
        plan, so a ValueError here is about S)."""
        spec = self.specs[est.name]

        def accepts(samples: int) -> bool:
            try:
                cell_draws(spec, est, q_shape, k_shape, [0], range(1), samples, mask)
            except ValueError:
                return False
            return True

        return accepts

    def _block_peak(self, est: EstimatorConfig, q, k, v, samples: int | None, reps: int, mask: Mask,
                    estimate: Callable[[Draws], Any]) -> int:
        """Peak bytes of one calibration block of ``reps`` replicates at ``samples``: the code path a unit runs --
        ``estimate(draws)``, the keys-used counts and log-denominators, the diagnostics
        (:func:`~randattn.analysis.cell_memory.measure_block_peak`)."""
        spec = self.specs[est.name]
        draws = cell_draws(spec, est, q.shape[1:], k.shape[1:], [0], range(reps), samples, mask)

        def one() -> None:
            facts = estimate(draws)[2]
            if spec.keys_used is not None and facts.keys_used is None:
                self.estimator.keys_used(spec, est, q, k, draws, mask=mask)
            if self.estimator.wants_log_denominator(spec, est) and facts.log_denominator is None:
                self.estimator.log_denominator(spec, est, q, k, draws, mask=mask)
            if self.config.diagnostics and est.random:
                self._diagnostics_block(est, q, k, v, draws, first_block=False, mask=mask)

        return measure_block_peak(one, draws, torch_tensors=self.torch is not None)

    def columns_reason(self, unit: Unit) -> str | None:
        """Why a tiled unit without probability factors leaves prob_mse NaN
        (:func:`~randattn.analysis.estimate_block.columns_skip_reason`), or None."""
        est = self.config.estimators[unit.est_index]
        itemsize = 8 if self._dtype_name(est) == "float64" else 4
        return columns_skip_reason(est.label, self.mask(unit), self.call_queries(unit), self.num_keys, itemsize,
                                   self.config.max_memory)

    @property
    def num_keys(self) -> int:
        """M, the keys of every query row (the activations' tokens)."""
        return int(self.acts.shape[2])

    def _sliced_calibration(self, unit: Unit) -> tuple[int, int]:
        """``(a, b)`` of a tiled unit (:meth:`~randattn.analysis.exact_cache.ExactCache.tiled`), forecast from two
        small slices of its first head, never by running it at full size.

        The tiled code path (the estimates, the probability error by key tiles, the keys-used counts and
        log-denominators, the diagnostics) is measured on slices of ``t / 2`` and ``t`` keys
        (:func:`~randattn.analysis.cell_memory.calibration_sizes`: 1,024 for a unit of every query, longer for a
        unit of few; at most as many queries), and each of ``a`` and ``b`` extrapolated to the unit's K
        queries and M keys by :func:`~randattn.analysis.cell_memory.extrapolate_peak`: a part that grows with
        K + M and one with K M (an estimator that forms a K x M array keeps its quadratic term, so it is refused, not
        OOM-killed). With the margin of :func:`~randattn.analysis.cell_memory.with_margin` at the full size.
        """
        est = self.config.estimators[unit.est_index]
        spec = self.specs[est.name]
        mask = self.mask(unit)
        columns = self.columns_reason(unit) is None  # the path the unit takes at its full size
        q, k, v = (a[:1] for a in self.inputs(unit))
        n, m = q.shape[-2], k.shape[-2]
        points = []
        for keys in calibration_sizes(m, n):
            queries = min(n, keys)
            # every query (n == m): the first tokens, a shorter sequence; the last K of M: the last rows over the
            # first keys (the causal shapes hold: keys >= queries)
            qs = q[..., :queries, :] if n == m else q[..., n - queries:, :]
            ks, vs = k[..., :keys, :], v[..., :keys, :]
            _, log_normaliser = self.exact_cache.tiled_exact(unit, qs, ks, vs)

            def peak_at(samples: int | None, reps: int, qs=qs, ks=ks, vs=vs, lz=log_normaliser) -> int:
                return self._block_peak(est, qs, ks, vs, samples, reps, mask,
                                        lambda draws: self.estimator.tiled_estimate(
                                            spec, est, qs, ks, vs, draws, lz, mask=mask, columns=columns))

            accepts = self._accepts(est, qs.shape[1:], ks.shape[1:], mask)
            points.append((queries, keys, fit_cell_model(peak_at, unit.num_samples, est.random, accepts)))
        widest = self.call_queries(unit)  # a query-blocked unit's calls hold a block's queries, its last every key
        a = extrapolate_peak([(kq, km, ab[0]) for kq, km, ab in points], widest, m)
        b = extrapolate_peak([(kq, km, ab[1]) for kq, km, ab in points], widest, m)
        return with_margin(a, b, queries=self.measured_queries, value_dim=v.shape[-1], key_dim=self.acts.shape[3],
                           num_samples=unit.num_samples)

    def blocks(self, unit: Unit) -> list[tuple[slice, slice]]:
        """(cells, replicates) blocks of ``unit`` under ``max_memory``
        (:func:`~randattn.analysis.cell_memory.split_blocks`).

        The block is canonical -- every head and every replicate of the unit, one estimator call
        whatever R -- whenever the budget holds it, so rows are bitwise identical across such
        budgets; smaller budgets split further, which can change results by rounding
        (:data:`~randattn.analysis.cell_memory.SPLIT_ROUNDING`).

        Raises
        ------
        MemoryBudgetError
            One (cell, replicate) alone exceeds the budget.
        """
        est = self.config.estimators[unit.est_index]
        per_cell, per_rep = self._calibration(unit)
        stored = self.stored_bytes(unit)  # held across the blocks: they get the rest of the budget
        check_fits(per_cell, per_rep, self.config.max_memory, label=est.label, num_samples=unit.num_samples,
                   tokens=self.acts.shape[2], stored=stored, replicates=self.replicates(est), heads=len(unit.heads))
        return split_blocks(len(unit.heads), self.replicates(est), self.config.max_memory - stored, per_cell, per_rep)

    def canonical(self, unit: Unit) -> bool:
        """Whether ``unit`` runs in its canonical block, every head and every replicate in one estimator call
        (:meth:`blocks`), rather than split to fit ``max_memory``."""
        cells, reps = self.blocks(unit)[0]
        return (cells.stop - cells.start == len(unit.heads)
                and reps.stop - reps.start == self.replicates(self.config.estimators[unit.est_index]))

    def query_blocks(self, unit: Unit) -> list[QueryBlock] | None:
        """The blocks of ``unit``'s measured queries, each estimated by one call with the keys it sees
        (:mod:`~randattn.analysis.query_blocks`); None where the unit is estimated in one call."""
        est = self.config.estimators[unit.est_index]
        spec, mask = self.specs[est.name], self.mask(unit)
        if not self.exact_cache.tiled(unit) or not blocks_queries(spec, spec.resolve_params(est.params), mask,
                                                                  self.measured_queries, self.num_keys):
            return None  # a block's truth is the tiled truth's rows: a dense truth is one K x M array already
        return split_queries(self.measured_queries, self.num_keys, mask)

    def call_queries(self, unit: Unit) -> int:
        """The most queries one estimator call of ``unit`` holds: a query block's rows, else every measured query."""
        blocks = self.query_blocks(unit)
        return self.measured_queries if blocks is None else blocks[0].rows.stop

    def replicates(self, est: EstimatorConfig) -> int:
        return self.config.replicates if est.random else 1

    # ------------------------------------------------------------------------------------------------ checks
    def _diagnostics_block(self, est: EstimatorConfig, q, k, v, draws: Draws, first_block: bool,
                           mask: Mask = NO_MASK):
        """:func:`~randattn.analysis.unit_diagnostics.diagnostics_block` with this run's settings (and ``mask``'s
        kind)."""
        return diagnostics_block(self.specs[est.name], est, q, k, v, draws, first_block, scale=self.scale,
                                 khat_queries=self.config.khat_queries, backend=self.config.backend,
                                 device=None if self.torch is None else self.device, dtype=self._dtype_name(est),
                                 mask=mask.kind)

    def _reference_deviation(self, spec, est: EstimatorConfig, q, k, v, draws: Draws, batched_first,
                             mask: Mask = NO_MASK, *, against_softmax: bool = True) -> ReferenceCheck:
        """The :class:`ReferenceCheck` of the unit's first cell and replicate (same draws, same mask).

        ``batched_first (N, Dv)``: the batched estimate of that cell and replicate, a tensor in the run's dtype.
        ``against_softmax=False``: no reference error (NaN), where the checked entries do not stand for the cell.
        """
        from randattn.estimators.softmax import reference as softmax

        # the reference is float64 numpy: the torch backend's inputs are in the file's dtype
        q1, k1, v1 = (np.asarray(a[:1], dtype=np.float64) for a in (q, k, v))
        ref = np.asarray(spec.reference(q1, k1, v1, _slice_draws(draws, slice(0, 1), slice(0, 1)), scale=self.scale,
                                        **est.params, **mask.estimator_kwargs), dtype=np.float64)[0, 0]
        batched = batched_first.to("cpu", self.torch.float64).numpy()
        error = (relative_max_error(ref, softmax.estimate(q1, k1, v1, None, scale=self.scale,
                                                          **mask.estimator_kwargs)[0])
                 if against_softmax else np.nan)
        return ReferenceCheck(max_abs_deviation(ref, batched), error, rms_deviation(ref, batched))

    def _sliced_reference_deviation(self, spec, est: EstimatorConfig, unit: Unit, q, k, v,
                                    mask: Mask = NO_MASK) -> ReferenceCheck:
        """:meth:`_reference_deviation` of a tiled unit, on its first cell's first
        :data:`~randattn.analysis.cell_memory.REFERENCE_CHECK_TOKENS` keys (and as many of its queries, the first
        or the last as in :meth:`_sliced_calibration`), with replicate 0's draws for that shape: the batched form
        against the reference where both are affordable."""
        n, m = q.shape[-2], k.shape[-2]
        keys = min(m, REFERENCE_CHECK_TOKENS)
        queries = min(n, keys)
        qs = q[:1, :queries] if n == m else q[:1, n - queries:]
        ks, vs = k[:1, :keys], v[:1, :keys]
        draws = cell_draws(spec, est, qs.shape[1:], ks.shape[1:], unit.seeds[:1], range(1), unit.num_samples, mask)
        torch = self.torch
        dt = getattr(torch, self._dtype_name(est))
        tq, tk, tv = (input_tensor(a, device=self.device, dtype=dt) for a in (qs, ks, vs))
        with torch.no_grad():
            batched = spec.batched(tq, tk, tv, draws.to_torch(device=self.device, dtype=dt), scale=self.scale,
                                   **est.params, **mask.estimator_kwargs)
        # a slice exact under the estimator (vAttention's default sinks and local keys cover 256 keys) says nothing
        # of the whole cell's exactness: no reference error, so the cell keeps its ratio
        return self._reference_deviation(spec, est, qs, ks, vs, draws, batched[0, 0], mask=mask,
                                         against_softmax=False)

    # ------------------------------------------------------------------------------------------------ a unit
    def run(self, unit: Unit) -> list[dict[str, Any]]:
        """The rows of ``unit`` (one per head and reported S), in head order.

        torch computes with ``config.threads`` intra-op threads and float32 matrix products in IEEE float32
        (:func:`randattn._precision.full_precision_matmul`; both restored afterwards), so that the rows are
        the same in every process that runs the unit and no TF32 rounding enters them.
        """
        return self.run_timed(unit).rows

    def run_timed(self, unit: Unit, *, query_blocks_timed: int | None = None) -> UnitResult:
        """:class:`UnitResult`: ``run(unit)``, the wall seconds of each of the unit's :data:`PHASES`, and its
        per-position rows (None when the unit's layer gets none).

        ``query_blocks_timed``: for timing alone (the dry run), a unit estimated in more query blocks than this
        computes only that many, evenly spaced (:func:`~randattn.analysis.query_blocks.timed_block_indices`); the
        other queries' entries are left at zero, so the rows are not the unit's.
        """
        if self.torch is None:
            return self._run(unit, query_blocks_timed)
        from randattn._precision import full_precision_matmul

        if self.config.threads is None:
            with full_precision_matmul():
                return self._run(unit, query_blocks_timed)
        before = self.torch.get_num_threads()
        self.torch.set_num_threads(self.config.threads)
        try:
            with full_precision_matmul():
                return self._run(unit, query_blocks_timed)
        finally:
            self.torch.set_num_threads(before)

    def _run(self, unit: Unit, query_blocks_timed: int | None = None) -> UnitResult:
        with raised_while(f"measuring {self.config.estimators[unit.est_index].label}", unit):
            return self._measured_run(unit, query_blocks_timed)

    def _measured_run(self, unit: Unit, query_blocks_timed: int | None = None) -> UnitResult:
        """Blocks -> exact attention -> per block: draws, estimates, diagnostics, reference check -> metrics -> rows."""
        clock = time.perf_counter
        start = clock()
        seconds = dict.fromkeys(PHASES, 0.0)
        config, cache, estimator = self.config, self.exact_cache, self.estimator
        est = config.estimators[unit.est_index]
        spec = self.specs[est.name]
        mask = self.mask(unit)
        dtype = self._dtype_name(est)
        blocks = self.blocks(unit)
        q, k, v, exact_probs, exact = cache.get(unit, dtype)
        log_normaliser = cache.log_normaliser(unit)  # None: the truth is dense; else tiled, no K x M array anywhere
        tiled = log_normaliser is not None
        columns_reason = self.columns_reason(unit) if tiled else None
        probabilities_skipped = False
        factored = not tiled and estimator.factors_pay(spec, est, unit.num_samples, q.shape[-2])
        exact32 = (cache.get(unit, "float32")[3] if not tiled and (factored or estimator.rounds_probabilities(spec, est))
                   else None)
        sq_norms = cache.sq_norms(unit) if factored else None
        seconds["exact"] = clock() - start  # the exact attention, computed by the first unit of an image-layer
        cells, reps = len(unit.heads), self.replicates(est)
        n, m, dv = q.shape[-2], k.shape[-2], v.shape[-1]
        query_blocks = self.query_blocks(unit)  # None: one call over every measured query
        timed_only = (query_blocks is not None and query_blocks_timed is not None
                      and len(query_blocks) > query_blocks_timed)
        if timed_only:  # the dry run's timing: a few blocks, the other queries' entries left at zero
            query_blocks = [query_blocks[i] for i in timed_block_indices(len(query_blocks), query_blocks_timed)]
        if self.torch is None:
            out = (np.zeros if timed_only else np.empty)((reps, cells, n, dv))  # the reference's float64 estimates
        else:
            # estimate - exact in float64 on the device: the estimates never cross to the host (issue 9, GPU-ready)
            exact_out = cache.output(unit)
            out = (self.torch.zeros if timed_only else self.torch.empty)((reps, cells, n, dv), dtype=self.torch.float64,
                                                                        device=self.device)
        prob_sq = np.full((reps, cells), np.nan)
        # per (replicate, cell): the mean and the largest over the queries of the keys each reads (spec.keys_used)
        counts_declared = spec.keys_used is not None
        keys_mean = np.full((reps, cells), np.nan) if counts_declared else None
        keys_max = np.full((reps, cells), np.nan) if counts_declared else None
        # per (replicate, cell, query): log Z_hat, where the promise is on the denominator
        log_denominators = np.full((reps, cells, n), np.nan) if estimator.wants_log_denominator(spec, est) else None
        diagnostics = UnitDiagnostics(reps, cells)
        diagnose = config.diagnostics and est.random
        skipped = diagnostics_skip_reason(spec, est.params, mask.kind, config.backend) if diagnose else None
        if skipped is not None:
            warnings.warn(skipped, DiagnosticsSkippedWarning, stacklevel=2)  # NaN with its reason, once per unit
            diagnose = False
        ref_check = ReferenceCheck()
        if query_blocks is not None and diagnose and spec.diagnostics_apply(spec.resolve_params(est.params)):
            warnings.warn(f"IS diagnostics (ESS, delta-method variance, k-hat) not computed for {est.label}: its "
                          f"{n} queries are estimated in blocks of {query_blocks[0].rows.stop}, each with draws of "
                          "its own, and the diagnostics describe one call's", DiagnosticsSkippedWarning, stacklevel=2)
        if query_blocks is not None:
            diagnose = False
        parts = query_blocks or [QueryBlock(None, slice(None), m)]
        order = largest_first(query_blocks) if query_blocks else [0]  # widest first: later blocks reuse its pages
        for cs, rs in blocks:
            part_probs: list = [None] * len(parts)
            block_counts = ((np.zeros if timed_only else np.empty)((rs.stop - rs.start, cs.stop - cs.start, n))
                            if counts_declared else None)
            for at in order:
                part = parts[at]
                mark = clock()
                qp, kp, vp = q[cs, part.rows], k[cs, :part.keys], v[cs, :part.keys]
                draws = cell_draws(spec, est, qp.shape[1:], kp.shape[1:], unit.seeds[cs], range(rs.start, rs.stop),
                                   unit.num_samples, mask, part.index)
                if est.random and rs.start == 0 and cs.start == 0 and part.index in (None, 0) and seed_ignored(draws):
                    warnings.warn(f"{est.label} is declared random, but its draw gave replicates 0 and 1 the same "
                                  "random variables from different generators: it ignores its rng, and its rows "
                                  "measure one draw (variance 0); run `randattn check` on it",
                                  SeedIgnoredWarning, stacklevel=2)
                mark = _lap(seconds, "draws", mark, clock)
                if tiled:
                    part_out, part_prob, facts = estimator.tiled_estimate(spec, est, qp, kp, vp, draws,
                                                                          log_normaliser[cs, part.rows], mask=mask,
                                                                          columns=columns_reason is None)
                    if part_prob is None and config.probabilities and not probabilities_skipped:
                        # NaN with its reason, once per unit (the run's warning records count it)
                        warnings.warn(columns_reason, ProbabilitiesSkippedWarning, stacklevel=2)
                        probabilities_skipped = True
                else:
                    part_out, part_prob, facts = estimator.estimate(
                        spec, est, qp, kp, vp, draws, exact_probs[cs] if config.probabilities else None,
                        None if exact32 is None else exact32[cs], rank=unit.num_samples,
                        exact_sq_norms=None if sq_norms is None else sq_norms[cs],
                        exact64=lambda cs=cs: cache.get(unit, "float64")[3][cs], mask=mask)
                if self.torch is None:
                    out[rs, cs, part.rows] = part_out
                else:
                    # in float64 (a float32 estimate converts exactly): the value numpy's float64(est) - exact gave
                    self.torch.sub(part_out, exact_out[cs, part.rows], out=out[rs, cs, part.rows])
                part_probs[at] = part_prob
                if counts_declared:
                    counts = facts.keys_used
                    if counts is None:  # not given by the estimate's own selection
                        counts = estimator.keys_used(spec, est, qp, kp, draws, mask=mask)
                    block_counts[..., part.rows] = counts
                if log_denominators is not None:
                    logs = facts.log_denominator
                    if logs is None:  # likewise
                        logs = estimator.log_denominator(spec, est, qp, kp, draws, mask=mask)
                    log_denominators[rs, cs, part.rows] = logs
                mark = _lap(seconds, "estimate", mark, clock)
            if all(part_prob is not None for part_prob in part_probs):  # summed over the query blocks
                prob_sq[rs, cs] = np.sum(part_probs, axis=0)
            if counts_declared:
                keys_mean[rs, cs], keys_max[rs, cs] = block_counts.mean(-1), block_counts.max(-1)
            used = diagnostics.wanted(rs) if diagnose else None
            if used is not None:  # one call over every query (query_blocks is None): its draws are the block's
                diagnostics.add(used, cs, self._diagnostics_block(
                    est, q[cs], k[cs], v[cs], _slice_draws(draws, slice(0, used.stop - used.start), slice(None)),
                    rs.start == 0, mask=mask))
            mark = _lap(seconds, "diagnostics", mark, clock)
            if unit.check_reference and rs.start == 0 and cs.start == 0 and self.torch is not None:
                if tiled:  # the reference at full length is a per-query loop (hours at 32k tokens): a slice of it
                    ref_check = self._sliced_reference_deviation(spec, est, unit, q[cs], k[cs], v[cs], mask=mask)
                else:
                    ref_check = self._reference_deviation(spec, est, q[cs], k[cs], v[cs], draws, part_out[0, 0],
                                                        mask=mask)
            _lap(seconds, "reference_check", mark, clock)
        mark = clock()
        metrics, rel, per_bucket, errors = output_metrics(
            out, exact if self.torch is None else exact_out, differences=self.torch is not None, random=est.random,
            scheme=config.positions_of(unit.layer), keys=m, queries=self.num_queries, rows=self.query_rows,
            relative_errors=True)
        prob_mse = prob_sq[: metrics.replicates].mean(0) / (n * m)
        visible = mask.visible_counts(self.num_queries, m)
        keys_used = keys_used_columns(keys_mean, keys_max, random=est.random, replicates=metrics.replicates,
                                      visible=float((visible if self.query_rows is None else
                                                     visible[self.query_rows]).mean()))
        promised = (None if log_denominators is None else
                    denominator_relative_errors(log_denominators, cache.log_normalisers(unit), random=est.random))
        relative = relative_error_columns(errors, config.epsilon, spec.promise_of(est.params), promised=promised,
                                          promise_on=spec.promise_on_of(est.params))
        ess_mean, delta_ratio, khat = diagnostics.columns(metrics.variance)
        _lap(seconds, "metrics", mark, clock)
        per_cell = (clock() - start) / cells
        model = str(self.acts.metadata.get("model", "unknown"))
        label = mask.label
        samples = unit.row_samples(config)
        tokens = self.num_queries  # the sequence's, whichever of its queries are measured (the queries column says)
        rows = table_rows(unit, est, samples, model=model, tokens=tokens, mask=label, dtype=dtype, metrics=metrics,
                          rel=rel, prob_mse=prob_mse if config.probabilities else None, ess_mean=ess_mean,
                          delta_ratio=delta_ratio, khat=khat, ref_check=ref_check, seconds=per_cell,
                          sink=cache.sink_mass(unit), queries=config.queries, keys_used=keys_used, relative=relative)
        positions = None if per_bucket is None else position_rows(unit, est, samples, model=model, tokens=tokens,
                                                                  mask=label, per_bucket=per_bucket)
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
