r"""Which queries a sweep measures: all of them, the last K, or a seeded sample of K (ARCHITECTURE sec. 14).

A sweep may measure a subset of the N query rows of every (image, layer, head) against all the keys they see:

``all``
    Every query (the default).
``last:K``
    The last K query rows. Under the causal mask (key m visible to query n iff :math:`m \le n + M - N`, the
    queries being the last N of the M tokens) this is exactly the decode regime: the estimator is called with
    ``q[..., -K:, :]`` and the full ``k, v``, and the convention puts those K queries at their own positions
    :math:`p = n + M - N + 1`. The estimate, the exact truth and every metric then hold K rows, never N: memory
    O(K M) per head.
``sample:K``
    K query rows drawn without replacement (sorted) by a generator seeded from the master seed alone
    (:func:`query_sample_seed`), the same rows for every image, layer, head and estimator of the run, recorded
    in the table's metadata.

What a subset means for an estimator
------------------------------------
The selected rows are handed to the estimator as its queries: every estimator runs as it would with those
queries alone (at decode time, the only queries there are). For an estimator whose output for query n depends
only on :math:`q_n`, the keys, the values and the draws, this measures the rows of the full run's distribution.
Two cases are refused before anything is computed (:func:`check_query_selection`), because the subset would
measure another estimator than the one asked for:

- **A sample under a mask.** The causal convention places N queries at the last N of M tokens; a
  non-contiguous set of rows has no such placement (a sampled query at token 3 would be measured as if it were
  token M - K + 1). ``last:K`` is the masked form.
- **A sample for an estimator whose windows end at the query's own token** (``query_placement="last-n-of-m"``:
  StreamingLLM's and vAttention's recent windows): a sampled row would be measured at another token.
- **A token layout without a mask** (``query_placement="proportional"``: LARA's segments, EVA's and
  Scatterbrain's blocks and chunks, local attention's windows). Without a mask, N != M queries map to key
  positions proportionally (:mod:`randattn.estimators.eva.partition`), so K < N rows would be placed at other
  blocks than their own, and LARA's and EVA's landmarks pool the queries present, as RFA's data-dependent maps
  (OPRF, SDERF) fit their parameters to them. Under the causal mask
  ``last:K`` keeps every query at its own token and is allowed: the estimator is the decode-time one, whose
  landmarks pool the K queries present.

Rows ``last:N`` and ``sample:N`` are every row (the table still records the selection as written).
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

import numpy as np

__all__ = [
    "QUERY_KINDS",
    "QueryPlacementError",
    "parse_query_selection",
    "selection_count",
    "query_rows",
    "query_sample_seed",
    "maps_query_positions",
    "places_queries_by_position",
    "check_query_selection",
]

#: the query selections: every row, the last K, or a seeded sample of K
QUERY_KINDS = ("all", "last", "sample")
_SELECTION = re.compile(r"^(last|sample):([0-9]+)$")
#: the spawn key that makes the query sample's stream distinct from every cell's (a cell's key is 8 words)
_SAMPLE_SPAWN_KEY = (0x51, 0x5E)


def parse_query_selection(value: Any) -> str:
    """``"all"``, ``"last:K"`` or ``"sample:K"`` (K a positive integer), canonical (lower case, no spaces).

    Raises
    ------
    ValueError
        Anything else, or K <= 0, saying what is allowed.
    """
    text = str(value).strip().lower() if isinstance(value, str) else None
    if text == "all":
        return text
    match = _SELECTION.match(text or "")
    if match is None:
        raise ValueError(f"query selection {value!r} is not one of all, last:K or sample:K (K a positive integer, "
                         "e.g. last:64)")
    count = int(match.group(2))
    if count <= 0:
        raise ValueError(f"query selection {value!r}: K must be a positive integer, got {count}")
    return f"{match.group(1)}:{count}"


def selection_count(selection: str) -> tuple[str, int | None]:
    """``(kind, K)`` of a canonical selection; K is None for ``"all"``."""
    if selection == "all":
        return "all", None
    kind, count = selection.split(":")
    return kind, int(count)


def query_sample_seed(master_seed: int) -> np.random.SeedSequence:
    """The seed sequence of a run's query sample: from the master seed alone, apart from every cell's stream."""
    return np.random.SeedSequence(int(master_seed), spawn_key=_SAMPLE_SPAWN_KEY)


def query_rows(selection: str, num_queries: int, master_seed: int = 0) -> np.ndarray | None:
    """The measured query rows, increasing int64 ``(K,)``; None for ``"all"``.

    Parameters
    ----------
    selection : str
        Canonical (:func:`parse_query_selection`).
    num_queries : int
        N, the query rows of the activations.
    master_seed : int
        The run's master seed (``sample:K`` only): the rows are
        ``sort(Generator(PCG64(query_sample_seed(seed))).choice(N, K, replace=False))``.

    Raises
    ------
    ValueError
        K > N.
    """
    kind, count = selection_count(selection)
    if kind == "all":
        return None
    if count > num_queries:
        raise ValueError(f"queries={selection!r} asks for {count} queries but the activations hold {num_queries} "
                         f"per head; use K <= {num_queries}")
    if kind == "last":
        return np.arange(num_queries - count, num_queries, dtype=np.int64)
    generator = np.random.Generator(np.random.PCG64(query_sample_seed(master_seed)))
    return np.sort(generator.choice(num_queries, size=count, replace=False)).astype(np.int64)


def maps_query_positions(spec: Any, params: Mapping[str, Any] | None = None) -> bool:
    """Whether the estimator spreads N != M queries over the keys in proportion without a mask (its spec's
    ``query_placement`` is ``proportional``: the windows, blocks and segments of
    :mod:`randattn.estimators.eva.partition`)."""
    return spec.query_placement_of(spec.resolve_params(params or {})) == "proportional"


def places_queries_by_position(spec: Any, params: Mapping[str, Any] | None = None) -> bool:
    """Whether the estimate of a query depends on its position beyond the mask (``query_placement`` other than
    ``independent``: StreamingLLM's and vAttention's recent windows end at token n + M - N), so that a sample of
    rows would be measured at other positions than its own."""
    return spec.query_placement_of(spec.resolve_params(params or {})) != "independent"


class QueryPlacementError(ValueError):
    """A subset of the queries would place an estimator's queries elsewhere among the keys than a full run does
    (module docstring): every query, or the causal ``last:K``, measures it faithfully.

    Attributes
    ----------
    label : str
        The estimator configuration.
    rows, num_queries : int
        The K rows selected of the N queries.
    sampled : bool
        True: a sample of rows for an estimator whose windows end at each query's own token; False: a subset for
        an estimator that places queries among the keys by position, without a mask (on ``layer``).
    layer : int or None
        The bidirectional layer named (``sampled`` False), else None.
    causal : bool
        Whether the configuration has a causal form, so that the causal ``last:K`` measures it.
    """

    def __init__(self, label: str, rows: int, num_queries: int, sampled: bool, layer: int | None = None,
                 causal: bool = True) -> None:
        super().__init__(label, rows, num_queries, sampled, layer, causal)
        self.label, self.rows, self.num_queries, self.sampled, self.layer = label, rows, num_queries, sampled, layer
        self.causal = causal

    @property
    def what(self) -> str:
        """The fact and why it cannot be measured, without what to do about it."""
        if self.sampled:
            return (f"estimator {self.label!r} cannot be measured on a sample of {self.rows} of {self.num_queries} "
                    "queries: its windows end at each query's own token (query n is token n + M - N), and sampled "
                    "rows would be measured at other tokens than their own")
        return (f"estimator {self.label!r} cannot be measured on {self.rows} of {self.num_queries} queries without a "
                f"mask (layer {self.layer}): its estimate of a query depends on where the queries sit among the keys "
                "(windows, blocks or segments placed by position) or on the others present (landmarks, or "
                "parameters fitted to them), so a subset of queries would measure another estimator")

    def __str__(self) -> str:
        if self.sampled:
            return f"{self.what}; use last:K, or queries='all'"
        return f"{self.what}; measure it with queries='all'" + (
            ", or under mask='causal' with last:K" if self.causal else "")


def check_query_selection(selection: str, num_queries: int, layer_kinds: Mapping[int, str | None],
                          estimators: Sequence[Any], master_seed: int = 0) -> None:
    """Refuse, before anything is computed, a selection the run cannot measure faithfully (module docstring).

    Parameters
    ----------
    selection : str
        Canonical.
    num_queries : int
        N.
    layer_kinds : mapping of int to mask kind
        The selected layers and their masks.
    estimators : sequence of EstimatorConfig
    master_seed : int

    Raises
    ------
    ValueError
        K > N; a sample of K < N rows on a masked layer (naming it).
    QueryPlacementError
        A sample for an estimator whose windows end at each query's token, or a configuration with a token layout
        on a bidirectional layer with K < N (naming it); a ``ValueError``.
    """
    rows = query_rows(selection, num_queries, master_seed)
    if rows is None or len(rows) == num_queries:
        return
    kind = selection_count(selection)[0]
    masked = sorted(layer for layer, mask in layer_kinds.items() if mask is not None)
    if kind == "sample" and masked:
        layer = masked[0]
        raise ValueError(
            f"queries={selection!r} cannot be measured on layer {layer} under mask {layer_kinds[layer]!r}: the mask "
            "places the N queries at the last N of the M tokens (key m visible to query n iff m <= n + M - N"
            f"{', and the last W of those' if str(layer_kinds[layer]).startswith('sliding') else ''}), which a "
            "non-contiguous sample of rows cannot express; use last:K (the decode regime) or a bidirectional run"
        )
    bidirectional = sorted(layer for layer, mask in layer_kinds.items() if mask is None)
    if not bidirectional:
        return
    from randattn.estimators.registry import get_spec

    for est in estimators:
        if kind == "sample" and places_queries_by_position(get_spec(est.name), est.params):
            raise QueryPlacementError(est.label, len(rows), num_queries, sampled=True)
        if maps_query_positions(get_spec(est.name), est.params):
            spec = get_spec(est.name)
            raise QueryPlacementError(est.label, len(rows), num_queries, sampled=False, layer=bidirectional[0],
                                      causal=spec.supports_mask("causal", spec.resolve_params(est.params)))
