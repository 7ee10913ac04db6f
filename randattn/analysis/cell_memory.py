r"""The memory model of a unit: bytes per (cell, replicate), calibrated, and the blocks a budget allows.

A block of c cells x r replicates is modelled to need ``c (a + b r)`` bytes: ``a`` per cell
whatever R, ``b`` per replicate. Both are calibrated once per (configuration, S, shape) by
:func:`~randattn.analysis.memory.measure_peak` on the code path that runs
(:func:`measure_block_peak`) at one cell with one and two replicates, after a warm-up call, at
S = 16 and 64 (or the nearest S above each that the configuration accepts, :func:`calibration_samples`), and
extrapolated linearly in S (every estimator's working set is affine in S)
(:func:`fit_cell_model`), plus the stored estimate (:func:`with_margin`). :func:`split_blocks`
cuts a unit into blocks under the budget; a unit whose single (cell, replicate) exceeds it is
refused with :class:`MemoryBudgetError` (:func:`check_fits`) before anything is computed.

What a unit holds across its blocks
-----------------------------------
The blocks are not all: a unit keeps the float64 estimate (or its difference from the exact
output) of every replicate and head, ``(R, C, N, Dv)``, until its metrics reduce them over the
replicates (:func:`~randattn.analysis.unit_rows.output_metrics`), whose temporaries take up to
about as much again (measured: 1.03 x the store without per-position buckets, 1.67 x with
``log2`` buckets, R = 500, C = 4, N = 197, Dv = 64). That store grows with R whatever the
block, and a calibration at one and two replicates does not see it: R = 2,000 of four
197-token heads peaked at 1.98 GB while the blocks were modelled at 17 MiB. The unit is
therefore modelled as ``stored + max(block, (STORE_FACTOR - 1) stored)`` with
``stored = 8 R C N Dv`` (:func:`stored_bytes`, :func:`unit_peak_bytes`); the blocks get the
budget less the store, and a unit whose store alone cannot fit is refused (:func:`check_fits`).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

from randattn.analysis.memory import measure_peak
from randattn.estimators.base import Draws

__all__ = ["CALIBRATION_KEYS", "CALIBRATION_PAIRS", "MIN_MAX_MEMORY", "MemoryBudgetError", "REFERENCE_CHECK_TOKENS", "SPLIT_ROUNDING",
           "STORE_FACTOR", "block_bytes", "calibration_samples", "calibration_sizes", "check_fits", "extrapolate_peak", "fit_cell_model", "format_bytes", "measure_block_peak", "split_blocks", "stored_bytes", "unit_peak_bytes",
           "with_margin"]

#: what a split below the canonical block does to a row, said alike by ``randattn mse``'s plan and the sweeps guide
#: (tests/analysis/test_sweep.py measures it): the bound of the estimates follows from both runs' rounding errors,
#: the MSE's from |mean((e + d)^2) - mean(e^2)| <= 2 max|d| RMSE + max|d|^2
SPLIT_ROUNDING = ("the torch kernels' rounding depends on a block's shape, so each estimate of a split unit may differ "
                  "from a run with more memory by up to twice its rounding error in the run's dtype (which "
                  "ref_max_abs_dev samples), and a row's MSE by up to about 4 ref_max_abs_dev / RMSE relative")

#: the unit's peak over its store of estimates ``8 R C N Dv`` once the metrics run: the store plus the metrics'
#: temporaries, measured at up to 1.67 x the store (module docstring), rounded up to 2 x
STORE_FACTOR = 3

#: the smallest memory budget (``max_memory``) that any unit could use: one replicate of one head at the smallest shape
#: (N = M = D = S = 1) measured 23 KiB (RA) to 70 KiB (Scatterbrain) with the margin of :func:`with_margin`
#: (torch backend, CPU); 16 KiB, below all of them, so a budget under it can never run anything and is refused as
#: soon as it is read, before a file is loaded
MIN_MAX_MEMORY = 16 * 2**10

#: the keys of the larger slice a tiled unit of every query is measured on (:func:`calibration_sizes`): a run of 32k
#: tokens is forecast from slices of 512 and 1024, never by running it
CALIBRATION_KEYS = 1024

#: the query-key pairs of the larger slice (:func:`calibration_sizes`): ``CALIBRATION_KEYS ** 2`` for a unit of every
#: query; a unit of few queries (the decode shape, ``--queries last:K``) is measured on longer slices of as many
#: pairs (K = 64: 8,192 and 16,384 keys), long enough to see a working set that stops growing with the keys (causal
#: RFA's prefix sums hold one group of tokens at a time: slices inside one group forecast 0.58 KB a key and a
#: replicate, which a run of 131,072 keys never holds)
CALIBRATION_PAIRS = CALIBRATION_KEYS**2

#: keys of the slice on which a tiled unit's batched form is checked against the reference (its reference is a
#: per-query loop at full length)
REFERENCE_CHECK_TOKENS = 256


def calibration_sizes(keys: int, queries: int | None = None) -> tuple[int, ...]:
    """The key counts of the slices a tiled unit of ``keys`` keys and ``queries`` measured queries is calibrated on:
    ``t / 2`` and ``t``, the unit's own size alone where it is no larger.

    ``t`` is :data:`CALIBRATION_KEYS`, or for fewer queries the largest power of two whose slice holds at most
    :data:`CALIBRATION_PAIRS` query-key pairs (``queries`` None: every query).
    """
    longest = CALIBRATION_KEYS
    if queries is not None and 0 < queries < CALIBRATION_KEYS:
        longest = 1 << ((CALIBRATION_PAIRS // queries).bit_length() - 1)
    if keys <= longest:
        return (int(keys),)
    return (longest // 2, longest)


def extrapolate_peak(points, queries: int, keys: int) -> int:
    r"""Bytes at ``queries`` x ``keys`` from peaks measured on smaller slices, by the model
    :math:`\alpha (K + M) + \beta K M`.

    The two coefficients solve the model at the two points ``(K_i, M_i, bytes_i)``; a negative one is set to 0 and
    the other taken as the largest that any point needs (so the forecast never falls below a measured peak scaled
    by its own term). Two slices that do not differ (a unit no larger than the calibration) give their peak.

    Parameters
    ----------
    points : sequence of (K_i, M_i, bytes_i)
        Measured at K_i queries and M_i keys: two, the second the larger, or one at the unit's own size.
    queries, keys : int
        The unit's K and M.
    """
    if len(points) == 1:  # measured at the unit's own size
        return int(points[0][2])
    (k1, m1, p1), (k2, m2, p2) = points
    s1, s2, x1, x2 = k1 + m1, k2 + m2, k1 * m1, k2 * m2
    det = s1 * x2 - s2 * x1
    if det == 0:
        return int(max(p1, p2) * max(1.0, (queries * keys) / max(x2, 1)))
    alpha = (p1 * x2 - p2 * x1) / det
    beta = (s1 * p2 - s2 * p1) / det
    if beta < 0:
        alpha, beta = max(p1 / s1, p2 / s2), 0.0
    elif alpha < 0:
        alpha, beta = 0.0, max(p1 / x1, p2 / x2)
    return int(alpha * (queries + keys) + beta * queries * keys)


#: S at which the working set is measured (then extrapolated linearly in S)
_CALIBRATION_SAMPLES = (16, 64)


class MemoryBudgetError(ValueError):
    """A unit cannot fit the memory budget (``max_memory``): one (cell, replicate) of it, or the estimates it keeps
    of every replicate, needs more (:func:`check_fits`).

    Attributes
    ----------
    needed : int
        Bytes the memory model says it needs.
    budget : int
        The budget, bytes.
    label : str
        The estimator configuration.
    num_samples : int or None
        Its S (None: the estimator takes none).
    tokens : int
        Tokens of the unit's layer.
    replicates, heads : int
        The unit's replicates and heads (their store is what did not fit when ``store`` is True).
    store : bool
        False: one replicate of one head alone exceeds the budget (a larger budget, fewer samples or fewer
        queries help);
        True: the estimates of all replicates and heads, kept until their metrics, exceed it.
    """

    def __init__(self, needed: int, budget: int, label: str, num_samples: int | None, tokens: int,
                 replicates: int = 1, heads: int = 1, store: bool = False) -> None:
        super().__init__(needed, budget, label, num_samples, tokens, replicates, heads, store)
        self.needed, self.budget, self.label, self.num_samples = needed, budget, label, num_samples
        self.tokens, self.replicates, self.heads, self.store = tokens, replicates, heads, store

    @property
    def what(self) -> str:
        """The fact, without what to do about it."""
        s = "" if self.num_samples is None else f" at S = {self.num_samples}"
        if not self.store:
            return (f"one replicate of one head of {self.label}{s} with {self.tokens} tokens needs about "
                    f"{format_bytes(self.needed)}, more than the memory budget of {format_bytes(self.budget)}")
        return (f"{self.label}{s} keeps the estimates of all {self.replicates:,} replicates of {self.heads} head(s) "
                f"with {self.tokens} tokens until their metrics, about {format_bytes(self.needed)} with the metrics' "
                f"working memory, more than the memory budget of {format_bytes(self.budget)}")

    def __str__(self) -> str:
        if not self.store:
            samples = (" (fewer samples help only where the estimator's memory grows with S)" if self.num_samples
                       else "")
            return f"{self.what}; raise max_memory or measure fewer queries (queries='last:K'){samples}"
        return f"{self.what}; use fewer replicates, select fewer heads, or raise max_memory"


def format_bytes(n: float) -> str:
    """``1536 -> '1.5 KiB'``, three significant digits in the largest unit that keeps the number below 1,000
    (``1000 * 1024 -> '0.977 MiB'``, where three digits of KiB would read ``1e+03``); bytes whole."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if unit == "B" and abs(n) < 1024:
            return f"{int(n)} B"
        if unit not in ("B", "TiB") and abs(float(f"{n:.3g}")) < 1000 or unit == "TiB":
            return f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} TiB"  # pragma: no cover


def draw_bytes(draws: Draws) -> int:
    """Bytes of the draws' arrays (made before the measured call, so :func:`measure_peak` does not see them)."""
    return sum(a.nbytes for a in draws.arrays.values())


def measure_block_peak(run: Callable[[], Any], draws: Draws, *, torch_tensors: bool) -> int:
    """Peak bytes of one calibration block: ``run()`` measured as the sweep runs it, plus its ``draws``.

    Parameters
    ----------
    run : callable
        The block's code path (estimates, the probability pass, diagnostics), without arguments.
    draws : Draws
        The block's draws, allocated before ``run``.
    torch_tensors : bool
        Count torch tensors too (the torch backend).
    """
    from randattn._precision import full_precision_matmul

    with warnings.catch_warnings(), full_precision_matmul():  # the code path and precision of the run
        warnings.simplefilter("ignore")  # calibration only: the real run reports warnings
        return measure_peak(run, torch_tensors=torch_tensors) + draw_bytes(draws)


def calibration_samples(num_samples: int, accepts: Callable[[int], bool]) -> tuple[int, ...]:
    """The S at which a unit of S = ``num_samples`` is measured: S itself up to 64; above, two smaller S.

    They are the smallest S from 16 and the smallest from 64 (or past the first) that the estimator ``accepts``
    (Quest's S must be a multiple of its page size, StreamingLLM's at least its sinks), and S itself where no two
    smaller ones are accepted.
    """
    low, high = _CALIBRATION_SAMPLES
    if num_samples <= high:
        return (num_samples,)
    first = next((s for s in range(low, num_samples) if accepts(s)), None)
    if first is None:
        return (num_samples,)
    second = next((s for s in range(max(high, first + 1), num_samples) if accepts(s)), None)
    return (num_samples,) if second is None else (first, second)


def fit_cell_model(peak_at: Callable[[int | None, int], int], num_samples: int | None, random: bool,
                   accepts: Callable[[int], bool] = lambda samples: True) -> tuple[int, int]:
    """``(a, b)`` of the model ``c (a + b r)``, from peaks measured at one cell (no margin).

    Parameters
    ----------
    peak_at : callable
        ``(S, replicates) -> peak bytes`` of one cell (:func:`measure_block_peak`).
    num_samples : int or None
        The unit's S (None: an estimator without samples).
    random : bool
        Whether the estimator is random: only then is a second replicate measured (a deterministic one has one).
    accepts : callable, optional
        ``S -> bool``: whether the configuration takes that S (:func:`calibration_samples`); every S by default.

    Notes
    -----
    A warm-up call comes first (caches, lazy imports), at the smallest accepted S from ``min(S, 16)``. Up to
    S = 64 the model is measured at S itself; above, at two smaller S (16 and 64 where accepted) and
    extrapolated affinely in S, never decreasing.
    """
    reps_measured = (1, 2) if random else (1,)

    def model_at(samples: int | None) -> tuple[int, int]:
        peaks = [peak_at(samples, r) for r in reps_measured]
        per_rep = max(peaks[-1] - peaks[0], 0) if len(peaks) > 1 else peaks[0]
        return max(peaks[0] - per_rep, 0), per_rep

    s = num_samples
    if s is None:
        peak_at(None, 1)  # warm-up: caches, lazy imports
        return model_at(None)
    points = calibration_samples(s, accepts)
    warm = next((t for t in range(min(s, _CALIBRATION_SAMPLES[0]), points[0]) if accepts(t)), points[0])
    peak_at(warm, 1)  # warm-up: caches, lazy imports
    if len(points) == 1:
        return model_at(s)
    (s1, s2) = points  # affine in S through the two calibration points
    (a1, b1), (a2, b2) = model_at(s1), model_at(s2)
    a = int(max(a1, a2) + max(a2 - a1, 0) / (s2 - s1) * (s - s2))
    b = int(max(b1, b2) + max(b2 - b1, 0) / (s2 - s1) * (s - s2))
    return a, b


def with_margin(a: int, b: int, *, queries: int, value_dim: int, key_dim: int,
                num_samples: int | None) -> tuple[int, int]:
    """``(a, b)`` as the budget counts them: a margin of 1.5 for allocator slack, and per (cell, replicate)
    the stored float64 estimate ``(N, Dv)`` and ``S x D`` of draws."""
    return int(1.5 * a), int(1.5 * b) + 8 * queries * value_dim + 8 * (num_samples or 1) * key_dim


def block_bytes(per_cell: int, per_rep: int, cells: int, reps: int) -> int:
    """Modelled peak bytes ``cells * (per_cell + per_rep * reps)`` of a block of ``cells`` x ``reps``."""
    return cells * (per_cell + per_rep * reps)


def stored_bytes(cells: int, reps: int, queries: int, value_dim: int) -> int:
    """Bytes of a unit's store of estimates, float64 ``(reps, cells, N, Dv)``, held across its blocks."""
    return 8 * reps * cells * queries * value_dim


def unit_peak_bytes(block: int, stored: int) -> int:
    """Modelled peak of a unit: its ``stored`` estimates plus the larger of a ``block``'s working set and the
    metrics' temporaries (``(STORE_FACTOR - 1) stored``)."""
    return stored + max(block, (STORE_FACTOR - 1) * stored)


def check_fits(per_cell: int, per_rep: int, budget: int, *, label: str, num_samples: int | None,
               tokens: int, stored: int = 0, replicates: int = 1, heads: int = 1) -> None:
    """Raises :class:`MemoryBudgetError` if one (cell, replicate) with the unit's ``stored`` estimates (``replicates``
    of ``heads`` heads, :func:`stored_bytes`) exceeds ``budget``, naming the configuration."""
    per = block_bytes(per_cell, per_rep, 1, 1)
    if per > budget:
        raise MemoryBudgetError(per, budget, label, num_samples, tokens)
    whole = unit_peak_bytes(per, stored)
    if whole > budget:
        raise MemoryBudgetError(whole, budget, label, num_samples, tokens, replicates, heads, store=True)


def split_blocks(cells: int, reps: int, budget: int, per_cell: int, per_rep: int) -> list[tuple[slice, slice]]:
    """(cells, replicates) blocks of a unit of ``cells`` x ``reps`` under ``budget`` (one (cell, replicate) fits).

    ``budget`` is what the blocks may use: the caller takes the unit's store of estimates off first
    (:func:`stored_bytes`).

    The canonical block is the whole unit -- every cell and every replicate -- whenever the
    budget holds it: one estimator call per unit, so the number of operator calls (kernel
    launches on a GPU) and of uploads per unit does not grow with R, and the estimators' BLAS
    calls see the same shapes whatever the budget, so rows are bitwise identical across such
    budgets (a batched matmul's rounding may depend on its batch size). Smaller budgets take
    every cell and as many replicates as fit, else one cell at a time; this can change results
    by rounding (:data:`SPLIT_ROUNDING`).
    """

    def most_reps(c: int) -> int:  # the most replicates a block of c cells holds within the budget
        return (budget // c - per_cell) // per_rep if per_rep else reps

    if block_bytes(per_cell, per_rep, cells, reps) <= budget:
        size = reps
    elif block_bytes(per_cell, per_rep, cells, 1) <= budget:
        size = most_reps(cells)
    else:
        size = max(1, most_reps(1))
        return [(slice(c, c + 1), slice(r, min(r + size, reps))) for c in range(cells)
                for r in range(0, reps, size)]
    return [(slice(0, cells), slice(r, min(r + size, reps))) for r in range(0, reps, size)]
