r"""Planning a sweep: its units, validated against the activations, and what running them will cost.

:func:`plan` lays out every unit of a :class:`~randattn.analysis.plan.SweepConfig` over an activation set and
refuses, before anything runs, a selection, mask or query selection the activations cannot take;
:func:`plan_sweep` adds the memory calibration and (``timing``) an estimate of the wall time, without writing
anything (:class:`SweepPlan`). Running the plan is :mod:`randattn.analysis.sweep_run`.
"""

from __future__ import annotations

import os
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from randattn.analysis.execute import MemoryBudgetError, UnitRunner
from randattn.analysis.query_blocks import QUERY_BLOCKS_TIMED, timed_block_indices
from randattn.analysis.plan import (
    SweepConfig,
    Unit,
    bind_token_layout,
    plan_units,
    select,
    total_cells,
    with_threads,
)
from randattn.results.parts import stored_unit_ids, unit_id_of, unreadable_parts

__all__ = ["SweepPlan", "as_activations", "bind_layout", "count_cells", "plan", "plan_sweep"]


def as_activations(source: Any, *, scale: float | None = None):
    """Adapter: an :class:`~randattn.activations.Activations`, a path, or ``{layer: (q, k, v)}`` arrays.

    Plain arrays are ``(images, heads, tokens, head_dim)`` per layer; ``scale`` is then required.
    """
    from randattn.activations import Activations, load_activations, make_activations

    if isinstance(source, Activations):
        return source
    if isinstance(source, (str, os.PathLike)):
        return load_activations(source)
    if isinstance(source, Mapping):
        if scale is None:
            raise ValueError("scale is required with plain arrays (the softmax temperature, e.g. head_dim ** -0.5)")
        return make_activations(source, {"scale": float(scale)})
    raise TypeError(f"expected Activations, a path or a mapping of arrays, got {type(source).__name__}")


# ------------------------------------------------------------------------------------------------------- the engine
def plan(activations: Any, config: SweepConfig) -> list[Unit]:
    """Every unit of ``config`` over ``activations``, in canonical order; validates the selection and the masks.

    Raises
    ------
    ValueError
        A selected layer, head or image the activations do not hold; a layer without a mask in a
        per-layer mask; an estimator that does not support a selected layer's mask (named, with
        its spec's reason: :func:`~randattn.analysis.masking.check_estimator_masks`); a query selection
        the run cannot measure (:func:`~randattn.analysis.queries.check_query_selection`: K > N, a
        sample under a mask, a token layout on a subset without a mask).
    """
    from randattn.analysis.queries import check_query_selection

    acts = as_activations(activations)
    if not isinstance(config, SweepConfig):
        raise TypeError(f"config must be a SweepConfig, got {type(config).__name__}")
    units = plan_units(acts.layers, acts.shape[1], acts.images, config)
    kinds = {layer: config.mask_of(layer) for layer in select("layers", config.layers, list(acts.layers))}
    check_query_selection(config.queries, int(acts.shape[2]), kinds, config.estimators, config.seed)
    _check_masks(acts, bind_layout(config, acts))  # with the patch grid the run will use (windows under a mask)
    return units


def _check_masks(acts, config: SweepConfig) -> None:
    """Refuse, before anything runs, every estimator configuration that cannot run under a selected layer's mask.

    Beyond the spec's declared masks, each configuration draws once for one head under each mask
    (a few arrays, no estimate): a parameter with no masked form (e.g. a feature map fitted from
    every key) is refused there, by the estimator's own message. A configuration that the run estimates a block of
    queries at a time (:mod:`~randattn.analysis.query_blocks`) draws for the widest block, as the run does: its draws
    for every query at once may hold a K x M array (vAttention's uniforms: 8 GiB at 32,768 tokens).
    """
    from randattn.analysis.masking import check_estimator_masks
    from randattn.analysis.query_blocks import blocks_queries, query_block_rows
    from randattn.estimators.masks import Mask
    from randattn.estimators.registry import get_spec

    kinds = {layer: config.mask_of(layer) for layer in select("layers", config.layers, list(acts.layers))}
    if all(kind is None for kind in kinds.values()):
        return
    _, _, n, d = acts.shape
    rows = config.query_rows(n)
    queries = n if rows is None else len(rows)  # the estimators see the measured queries and every key
    for est in config.estimators:
        spec = get_spec(est.name)
        samples = min(config.num_samples) if est.needs_samples else None  # the smallest draw says as much

        def probe(kind: str, spec=spec, est=est, samples=samples) -> None:
            mask = Mask.parse(kind)
            blocked = blocks_queries(spec, spec.resolve_params(est.params), mask, queries, n)
            rows = query_block_rows(n) if blocked else queries
            spec.draw((1, rows, d), (1, n, d), num_samples=samples, replicates=1, rng=np.random.default_rng(0),
                      **est.params, **mask.estimator_kwargs)

        check_estimator_masks(spec, est.label, kinds, isinstance(config.mask, tuple), probe)


def bind_layout(config: SweepConfig, acts) -> SweepConfig:
    """``config`` with every estimator bound to the activations' patch grid (:func:`~randattn.analysis.plan.bind_token_layout`)."""
    from dataclasses import replace

    grid = getattr(acts, "grid", None)
    prefix = int(getattr(acts, "prefix_tokens", 0) or 0)
    bound = tuple(bind_token_layout(e, grid, prefix) for e in config.estimators)
    return config if bound == config.estimators and all(
        a.params_json == b.params_json for a, b in zip(bound, config.estimators)) else replace(config, estimators=bound)


def count_cells(activations: Any, config: SweepConfig) -> int:
    """Number of (image, layer, head, estimator config, S-group) cells ``config`` runs; validates the selection.

    Raises
    ------
    ValueError
        A selected layer, head or image that the activations do not hold.
    """
    return total_cells(plan(activations, config))


@dataclass(frozen=True)
class SweepPlan:
    """What a sweep will do, worked out before it does it (:func:`plan_sweep`).

    Attributes
    ----------
    config : SweepConfig
        The configuration, bound to the activations (token layout, threads).
    units : tuple of Unit
        Every unit, in canonical order.
    todo : tuple of Unit
        The units still to compute (all of them, unless resuming).
    unreadable : tuple of str
        Stored parts that cannot be read: the sweep sets them aside and computes their units again
        (they are in ``todo``).
    layers, heads : tuple of int
    images : tuple of str
        The selection.
    peak_bytes : int
        The memory model's estimate of the largest block of estimator work among ``todo``
        (:meth:`~randattn.analysis.execute.UnitRunner.block_bytes`; the activations and the
        interpreter come on top).
    split_units : int
        Units of ``todo`` that the budget splits below the canonical block of every head x every
        replicate (their rows may then differ by rounding from a larger budget's:
        :data:`~randattn.analysis.cell_memory.SPLIT_ROUNDING`).
    refused : MemoryBudgetError or None
        Why the sweep will be refused before computing (a unit cannot fit ``max_memory``): the error that
        :func:`run_sweep` raises with this plan, else None.
    seconds : float or None
        Estimated wall seconds of computing ``todo`` in this process (``timing=True``), else None.
    timed_heads : tuple of int
        The head counts that were timed for ``seconds``: one, and two where a unit has more heads.
    query_blocked : int
        Units of ``todo`` estimated a block of queries at a time (:mod:`~randattn.analysis.query_blocks`).
    """

    config: SweepConfig
    units: tuple
    todo: tuple
    unreadable: tuple
    layers: tuple
    heads: tuple
    images: tuple
    peak_bytes: int
    split_units: int
    refused: MemoryBudgetError | None
    seconds: float | None = None
    timed_heads: tuple = ()
    runner: Any = field(default=None, repr=False, compare=False)  # calibrated; run_sweep reuses it
    query_blocked: int = 0

    @property
    def cells(self) -> int:
        """Cells of the whole sweep (one per unit and head)."""
        return total_cells(self.units)

    @property
    def todo_cells(self) -> int:
        """Cells still to compute."""
        return total_cells(self.todo)


@contextmanager
def _pinned_threads(runner: UnitRunner):
    """For the block, torch computes with the sweep's intra-op threads (as :meth:`UnitRunner.run_timed` does)."""
    torch, threads = runner.torch, runner.config.threads
    if torch is None or threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def plan_sweep(activations: Any, config: SweepConfig, *, parts_dir: str | os.PathLike | None = None,
               resume: bool = False, timing: bool = False,
               before_timing: Callable[[int], Any] | None = None) -> SweepPlan:
    """Plan a sweep without running it or writing anything: its units, memory and (``timing``) wall time.

    Parameters
    ----------
    activations : Activations, path or mapping
        See :func:`as_activations`.
    config : SweepConfig
    parts_dir : path, optional
        With ``resume``: the parts folder whose finished units are not computed again (read only).
    resume : bool
    timing : bool
        Estimate the wall time: for each (configuration, S, mask) still to compute, one and two heads
        of its first unit are computed, timed, and the time of a unit taken as linear in its heads (a unit
        of one or two heads is computed whole, timed); one head is computed untimed first (first calls,
        lazy imports). Those results are dropped. Costs about 4 / (heads x layers x images) of the sweep,
        about one unit per configuration and S where units hold one or two heads.
    before_timing : callable, optional
        Called with the number of units split to fit the budget, once the memory is planned and before anything
        is timed: the CLI sets its process's allocator policy there, so that the timing runs under the run's
        (:func:`randattn._process.retain_freed_memory`).

    Returns
    -------
    SweepPlan
        Its ``runner`` holds the memory calibration, which :func:`run_sweep` reuses when given the
        plan (``calibrated=``).

    Raises
    ------
    ValueError
        A selection or mask the activations refuse (as :func:`plan`). A unit that cannot fit the
        budget is not raised but reported in ``refused``.
    """
    from dataclasses import replace

    acts = as_activations(activations)
    config = with_threads(bind_layout(config, acts))
    units = plan(acts, config)
    unreadable: dict = {}
    stored: set[str] = set()
    if parts_dir is not None and resume:
        unreadable = unreadable_parts(parts_dir)
        stored = stored_unit_ids(parts_dir)
        stored -= {unit_id_of(path) for path in unreadable}  # a per-position part takes its unit along
    todo = tuple(u for u in units if u.uid not in stored)
    runner = UnitRunner(acts, config)
    peak, split, refused = 0, 0, None
    first_of: dict[tuple, Unit] = {}
    for unit in todo:
        first_of.setdefault((unit.label, unit.num_samples, config.mask_of(unit.layer)), unit)
    layout: dict[tuple, tuple[int, bool]] = {}
    with _pinned_threads(runner):  # calibrated as it runs: with the run's threads (a small machine's cores are few)
        for key, unit in first_of.items():
            try:
                blocks = runner.blocks(unit)
            except MemoryBudgetError as exc:
                refused = refused or exc
                peak = max(peak, runner.cell_bytes(unit))
                continue
            cells, reps = blocks[0]
            layout[key] = (runner.block_bytes(unit, cells.stop - cells.start, reps.stop - reps.start),
                           runner.canonical(unit))
    blocked = 0
    for unit in todo:
        bytes_, canonical = layout.get((unit.label, unit.num_samples, config.mask_of(unit.layer)), (0, True))
        peak = max(peak, bytes_)
        split += not canonical
        blocked += runner.query_blocks(unit) is not None
    if before_timing is not None:
        before_timing(split)
    seconds, timed = None, ()
    if timing and refused is None and todo:
        heads = len(todo[0].heads)  # every unit holds the selected heads
        # one and two heads give the per-head slope; a unit of one or two heads is timed whole (timing it with one
        # head first made the dry run of a small selection cost more than the run)
        seconds, timed = 0.0, (1, 2) if heads > 2 else (heads,)
        per_unit, reference = {}, {}
        checked = {(u.label, u.num_samples, config.mask_of(u.layer)) for u in todo if u.check_reference}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the run reports warnings; a timing run says nothing
            first = todo[0]  # untimed: what a run does once (lazy imports, first calls) is not a unit's time
            runner.run_timed(replace(first, heads=first.heads[:1], seeds=first.seeds[:1], check_reference=False),
                             query_blocks_timed=1)  # one query block warms what the rest would
            for key, unit in first_of.items():
                times = []
                for h in timed:
                    # the float64 reference spot check of a checked unit runs on its first head only (a per-query
                    # loop on a slice of a tiled one): timed once, with the first timing, as its own phase
                    sub = replace(unit, heads=unit.heads[:h], seeds=unit.seeds[:h],
                                  check_reference=key in checked and h == timed[0])
                    start = time.perf_counter()
                    phases = runner.run_timed(sub, query_blocks_timed=QUERY_BLOCKS_TIMED).seconds
                    elapsed = time.perf_counter() - start - phases["reference_check"]
                    # a unit in many query blocks is timed on a few, evenly spaced: their draws and estimates
                    # stand for all of them (the truth and the metrics are the whole unit's already)
                    blocks = runner.query_blocks(sub)
                    if blocks is not None and len(blocks) > QUERY_BLOCKS_TIMED:
                        computed = len(timed_block_indices(len(blocks), QUERY_BLOCKS_TIMED))
                        elapsed += (phases["draws"] + phases["estimate"]) * (len(blocks) / computed - 1)
                    times.append(elapsed)
                    reference.setdefault(key, phases["reference_check"])
                if len(times) > 1:
                    per_unit[key] = times[0] + max(times[-1] - times[0], 0.0) * (len(unit.heads) - 1)
                else:
                    per_unit[key] = times[0] * len(unit.heads) / timed[0]
        for unit in todo:
            key = (unit.label, unit.num_samples, config.mask_of(unit.layer))
            seconds += per_unit[key] + (reference[key] if unit.check_reference else 0.0)
    acts_layers = select("layers", config.layers, list(acts.layers))
    heads = select("heads", config.heads, range(acts.shape[1]))
    images = tuple(acts.images[i] for i in select("images", config.images, range(len(acts.images))))
    return SweepPlan(config, tuple(units), todo, tuple(str(p) for p in unreadable), tuple(acts_layers),
                     tuple(heads), images, int(peak), int(split), refused, seconds, timed, runner,
                     query_blocked=blocked)
