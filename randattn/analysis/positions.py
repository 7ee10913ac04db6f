r"""Error by query position: the buckets, their metrics, their table (ARCHITECTURE sec. 12).

Under a causal mask query n sees :math:`p_n = n + (M - N) + 1` keys, so an early query averages
few values and its estimate errs differently from a late one: one MSE over all queries hides that.
The sweep therefore also reports the metrics of each cell restricted to the queries of a
**position bucket**.

Position
    :math:`p_n = n + (M - N) + 1`, the query's 1-based position among the M tokens
    (:func:`~randattn.analysis.masking.query_positions`): under the causal mask the number of keys
    it sees; with M == N its index + 1.
Buckets
    ``"log2"`` (the default under a mask): :math:`[1, 1], [2, 3], [4, 7], [8, 15], \dots`, the last
    one cut at M. Explicit lower edges :math:`1 = e_0 < e_1 < \dots` give :math:`[e_i, e_{i+1} - 1]` and
    a last bucket :math:`[e_{last}, M]`, so every query falls in a bucket; the first edge must be 1
    (edges ``8161`` would leave positions 1 to 8160 out, and ``100000`` every position of a shorter
    run). Edges above M give no bucket, and buckets holding no measured query are left out.
Metrics
    Those of :func:`randattn.analysis.metrics.replicate_metrics` (MSE, its SE, variance, debiased
    and naive bias², the jackknife SE of the bias²) over the bucket's queries and the value dims,
    from the same replicates as the cell's row.

The per-position table (:data:`POSITION_COLUMNS`) has one row per (cell, bucket); the sweep stores
it beside its main table (``<out>.positions<suffix>``), one part per unit like the main table's.
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import numpy as np

from randattn.analysis.masking import query_positions
from randattn.results.schema import POSITION_COLUMNS  # the per-position table's columns, defined with the table's

__all__ = [
    "POSITION_COLUMNS",
    "BUCKET_CHOICES",
    "parse_position_buckets",
    "position_buckets",
    "bucket_query_slices",
    "bucket_metrics",
    "bucket_text",
]

#: the named bucketings; ``auto``: ``log2`` on masked layers, none on bidirectional ones
BUCKET_CHOICES = ("auto", "none", "log2")


def parse_position_buckets(value: Any, name: str = "position buckets") -> str | tuple[int, ...]:
    """``"auto"``, ``"none"``, ``"log2"`` or strictly increasing lower edges starting at 1 (``"1,2,4,8,64"`` or ints).

    The first edge is 1 so that every query (positions start at 1) falls in a bucket; the last bucket is
    open-ended (it ends at M), so then every query does.

    Parameters
    ----------
    value : str or sequence of int
    name : str
        What the messages call ``value`` (``"--position-buckets"`` on the command line).

    Raises
    ------
    ValueError
        Anything else, saying what is allowed; edges whose first is not 1, naming them and the edges with 1 added.
    """
    if isinstance(value, str):
        text = value.strip().lower()
        if text in BUCKET_CHOICES:
            return text
        items: list[Any] = [part.strip() for part in text.split(",") if part.strip()]
    else:
        items = list(value) if isinstance(value, (list, tuple)) else []
    edges: list[int] = []
    for item in items:
        if isinstance(item, str) and item.isdigit():
            edges.append(int(item))
        elif isinstance(item, (int, np.integer)) and not isinstance(item, bool):
            edges.append(int(item))
        else:
            edges = []
            break
    if not edges or edges[0] < 1 or any(b <= a for a, b in zip(edges, edges[1:])):
        raise ValueError(f"{name} {value!r}: use log2, none, auto or strictly increasing positive lower "
                         "edges such as 1,2,4,8,64")
    if edges[0] != 1:
        raise ValueError(f"{name} {value!r}: the first lower edge must be 1, so that every query falls in a bucket "
                         f"(positions start at 1, and those below the first edge would be in none); use "
                         f"{','.join(map(str, [1, *edges]))}")
    return tuple(edges)


def position_buckets(scheme: str | Sequence[int], max_position: int) -> tuple[tuple[int, int], ...]:
    """The inclusive ``(lo, hi)`` position ranges of ``scheme`` up to ``max_position`` (M).

    Parameters
    ----------
    scheme : ``"log2"`` or sequence of int
        As :func:`parse_position_buckets` returns (not ``"auto"`` / ``"none"``, which choose whether to bucket).
    max_position : int
        The largest position, M.

    Examples
    --------
    >>> position_buckets("log2", 10)
    ((1, 1), (2, 3), (4, 7), (8, 10))
    >>> position_buckets((1, 4, 64), 10)
    ((1, 3), (4, 10))
    """
    if isinstance(scheme, str):
        if scheme != "log2":
            raise ValueError(f"position_buckets: {scheme!r} is not a bucketing; use log2 or lower edges")
        edges = [1 << i for i in range(max(int(max_position), 1).bit_length())]
    else:
        edges = list(parse_position_buckets(tuple(scheme)))  # the edges' rule, said once
    buckets = []
    for i, lo in enumerate(edges):
        if lo > max_position:
            break
        hi = edges[i + 1] - 1 if i + 1 < len(edges) else max_position
        buckets.append((lo, min(hi, int(max_position))))
    return tuple(buckets)


def bucket_query_slices(scheme: str | Sequence[int], num_queries: int, num_keys: int,
                        rows: Sequence[int] | None = None) -> list[tuple[int, int, slice]]:
    """``(lo, hi, queries)`` of every bucket holding a measured query: the queries as a slice of the measured rows.

    Parameters
    ----------
    scheme : ``"log2"`` or sequence of int
    num_queries, num_keys : int
        N and M of the activations: the positions are :math:`p_n = n + (M - N) + 1` and the buckets end at M.
    rows : sequence of int, optional
        The measured query rows, increasing (:mod:`randattn.analysis.queries`); default every row. A bucket's
        measured queries are a slice of them, because positions increase with the row.
    """
    positions = query_positions(num_queries, num_keys)
    measured = positions if rows is None else positions[np.asarray(rows, dtype=np.intp)]
    out = []
    for lo, hi in position_buckets(scheme, int(positions[-1])):
        start = int(np.searchsorted(measured, lo, side="left"))
        stop = int(np.searchsorted(measured, hi, side="right"))
        if stop > start:
            out.append((lo, hi, slice(start, stop)))
    return out


def bucket_text(lo: int, hi: int, measured: int | None = None) -> str:
    """``"1"``, ``"2-3"``: how a bucket is labelled in figures and reports; with ``measured``, the queries of it that
    were measured, where fewer than its positions (``"4096-8191 (63 measured)"``, the last 64 queries of 8,192:
    their error is not the bucket's average)."""
    text = str(int(lo)) if int(lo) == int(hi) else f"{int(lo)}-{int(hi)}"
    if measured is not None and int(measured) < int(hi) - int(lo) + 1:
        text += f" ({int(measured)} measured)"
    return text


def bucket_metrics(out: Any, exact: Any, buckets: Sequence[tuple[int, int, slice]], *, random: bool,
                   differences: bool) -> list[tuple[int, int, int, Any]]:
    r"""The replicate metrics of each bucket's queries: ``[(lo, hi, queries, ReplicateMetrics), ...]``.

    Parameters
    ----------
    out : (R, C, N, Dv) ndarray or float64 torch.Tensor
        The replicates :math:`y_r` (``differences=False``, numpy) or :math:`y_r - y` (``differences=True``,
        torch, as the sweep holds them on the device). Not modified.
    exact : (C, N, Dv)
        The exact output y (same kind as ``out``).
    buckets : sequence of (lo, hi, slice)
        From :func:`bucket_query_slices`.
    random : bool
        As :func:`~randattn.analysis.metrics.replicate_metrics`.
    differences : bool
        Whether ``out`` holds differences (the torch path, :func:`~randattn.analysis.metrics.metrics_of_differences`).

    Notes
    -----
    Each bucket's metrics are :func:`~randattn.analysis.metrics.replicate_metrics` restricted to the
    bucket's queries :math:`n \in B`:
    :math:`\mathrm{MSE}_B = \frac{1}{R\,|B|\,D_v} \sum_r \sum_{n \in B} \sum_d (y_{rnd} - y_{nd})^2`, and so on.
    Their warnings (too few replicates) repeat the cell's own and are not raised again.
    """
    from randattn.analysis.metrics import metrics_of_differences, replicate_metrics

    results = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the cell's row already warned of the same replicates
        for lo, hi, queries in buckets:
            if differences:
                # metrics_of_differences overwrites its input: a copy of the bucket, never the unit's array
                metrics, _ = metrics_of_differences(out[:, :, queries].clone(), exact[:, queries].contiguous(),
                                                    random=random)
            else:
                metrics = replicate_metrics(np.asarray(out)[:, :, queries], np.asarray(exact)[:, queries],
                                            random=random)
            results.append((int(lo), int(hi), int(queries.stop - queries.start), metrics))
    return results
