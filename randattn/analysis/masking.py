r"""Attention masks in the measurement engine: what a run's layers use, what the exact reference sees.

A sweep measures each layer under one mask kind (ARCHITECTURE sec. 12):

- ``None``: every query sees every key (bidirectional, a ViT);
- ``"causal"``: key m is visible to query n iff :math:`m \le n + (M - N)` -- the one rule of
  :func:`randattn.estimators.masks.causal_visible`, used here, never restated;
- ``"sliding:W"``: the causal rule cut to the last W keys, :math:`n + (M - N) - W < m \le n + (M - N)`
  (each query sees itself and the W - 1 keys before it, as transformers' sliding-window layers do).

A layer's mask is one :class:`~randattn.estimators.masks.Mask` (its kind, table label, estimator
keywords and visible keys); the sweep passes that value around
(:meth:`~randattn.analysis.plan.SweepConfig.layer_mask`). The kind strings above are how run
metadata and activation files store it (:func:`parse_mask_kind`, :func:`normalize_layer_masks`);
the older helpers that re-derived a label, keywords or visibility from a kind are deprecated.

The exact float64 softmax (the ground truth of every error the sweep reports) is taken over the
visible keys only, with the others exactly 0, in the probabilities too. An estimator runs under a
mask only when its spec declares it (:attr:`~randattn.estimators.base.EstimatorSpec.masks`;
``"sliding"`` for every window, which softmax and top-k declare); a layer whose mask an estimator does
not declare is refused by name before anything is computed (:func:`check_estimator_masks`).
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Callable, Mapping

import numpy as np

from randattn.estimators.masks import MASKS, Mask, check_causal_shapes, last_visible_key

__all__ = [
    "MASK_CHOICES",
    "parse_mask_kind",
    "query_positions",
    "masks_of_activations",
    "normalize_layer_masks",
    "check_estimator_masks",
    "takes_mask",
    "diagnostics_skip_reason",
    # deprecated: the Mask's own attributes and methods say these
    "mask_label",
    "sliding_window",
    "visible_keys",
    "visible_key_counts",
    "estimator_mask_kwargs",
]

#: how a run's mask is chosen on the command line (``randattn mse --mask``): one of the masks an estimator can
#: declare (:data:`~randattn.estimators.masks.MASKS`, by label) for every layer, or ``file``: the activation
#: file's own metadata
MASK_CHOICES = (*(Mask.parse(mask).label for mask in MASKS), "file")


def parse_mask_kind(kind: Any, where: str = "mask") -> str | None:
    """``None`` / ``"none"`` -> None, ``"causal"``, ``"sliding:W"`` (W a positive integer); ValueError otherwise.

    The kind of :meth:`Mask.parse(kind, where) <randattn.estimators.masks.Mask.parse>`.
    """
    return Mask.parse(kind, where).kind


def query_positions(num_queries: int, num_keys: int) -> np.ndarray:
    r"""``(N,)`` 1-based position of each query in the sequence of M tokens: :math:`p_n = n + (M - N) + 1`.

    The queries are the last N of the M tokens (ARCHITECTURE sec. 12), so under the causal mask
    :math:`p_n` is the number of keys query n sees; with M == N it is the query's index + 1.
    """
    check_causal_shapes(num_queries, num_keys)
    return last_visible_key(num_queries, num_keys) + 1


def normalize_layer_masks(masks: Any) -> str | None | tuple[tuple[int, str | None], ...]:
    """A run's mask in canonical form: one kind for every layer, or ``((layer, kind), ...)`` sorted by layer.

    Parameters
    ----------
    masks : None, str, or mapping of layer -> kind (or pairs)
        A mapping whose layers all share one kind collapses to that kind, so that a file that marks
        every layer causal and ``--mask causal`` give the same run (and the same manifest).

    Raises
    ------
    ValueError
        A kind that is not a mask kind, or a layer that is not an integer.
    """
    if masks is None or isinstance(masks, str):
        return parse_mask_kind(masks)
    pairs = masks.items() if isinstance(masks, Mapping) else masks
    try:
        per_layer = {int(layer): parse_mask_kind(kind, f"mask of layer {layer}") for layer, kind in pairs}
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ValueError) and "mask" in str(exc):
            raise
        raise ValueError(f"mask must be None, a mask kind or a mapping of layer -> kind, got {masks!r}") from None
    kinds = set(per_layer.values())
    if len(kinds) <= 1:
        return next(iter(kinds)) if kinds else None
    return tuple(sorted(per_layer.items()))


def masks_of_activations(acts: Any) -> str | None | tuple[tuple[int, str | None], ...]:
    """The mask kinds an activation file records (its metadata ``mask``), canonical; None when it records none.

    The file's metadata holds either one kind for every layer or ``{"<layer>": kind}``
    (:mod:`randattn.activations.io`); a file without the field is bidirectional.

    Raises
    ------
    ValueError
        The field holds something that is not a mask kind (naming the layer).
    """
    recorded = (getattr(acts, "metadata", None) or {}).get("mask")
    try:
        return normalize_layer_masks(recorded)
    except ValueError as exc:
        raise ValueError(f"the activation file's metadata 'mask': {exc}") from None


def check_estimator_masks(spec: Any, label: str, layer_kinds: Mapping[int, str | None], per_layer: bool,
                          probe: Callable[[str], None] | None = None) -> None:
    """Refuse, before anything is computed, an estimator configuration that cannot run under a layer's mask.

    Parameters
    ----------
    spec : EstimatorSpec
    label : str
        The configuration's label, named in the message.
    layer_kinds : mapping of int to kind
        The selected layers and their masks.
    per_layer : bool
        Whether the kinds differ between layers (the message then names the layer).
    probe : callable, optional
        ``probe(kind)`` raises ValueError when this configuration's parameters have no form under
        ``kind`` (e.g. a feature map fitted from every key), although the spec supports the mask.

    Raises
    ------
    ValueError
        Naming the estimator, the mask, the layer where it matters, and the spec's reason
        (:meth:`~randattn.estimators.base.EstimatorSpec.check_mask`).
    """
    checked: set[str | None] = set()
    for layer in sorted(layer_kinds):
        kind = layer_kinds[layer]
        if kind is None or kind in checked:
            continue
        checked.add(kind)
        where = f"layer {layer} has mask {kind!r}: " if per_layer else ""
        window = Mask.parse(kind).window
        if window is not None and not spec.supports_mask(kind):
            # masks_of, not the field: a family may declare its masks as a function of its parameters (rfa, eva)
            supported = ", ".join("none" if m is None else repr(m) for m in spec.masks_of())
            why = spec.mask_notes.get("sliding")
            why = why(spec.resolve_params({})) if callable(why) else why
            raise ValueError(
                f"layer {layer} uses a sliding-window mask ({kind!r}: each query sees its last {window} keys), which "
                f"estimator {spec.name!r} does not compute (it supports: {supported}"
                + (f"; {why}" if why else "") + "); leave the layer out with --layers, or choose another mask with "
                "--mask"
            )
        try:
            spec.check_mask(kind)
            if probe is not None:
                probe(kind)
        except ValueError as exc:
            text = str(exc)
            named = text if spec.name in text or label in text else f"estimator {label!r}: {text}"
            raise ValueError(where + named) from None


def takes_mask(function: Callable[..., Any] | None) -> bool:
    """Whether ``function`` accepts a ``mask`` keyword (a named parameter or ``**kwargs``).

    .. deprecated::
        Whether a provider computes under a mask is declared, not read from its signature:
        :attr:`ImportanceWeights.masks <randattn.estimators.base.ImportanceWeights>` (see
        :func:`diagnostics_skip_reason`).
    """
    import warnings

    warnings.warn("randattn.analysis.masking.takes_mask is deprecated: a provider declares the masks it computes "
                  "under (ImportanceWeights(masks=...)); ask spec.importance_weights.masks_of(params)",
                  DeprecationWarning, stacklevel=2)
    if function is None:
        return False
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: assume the narrowest protocol
        return False
    return any(p.name == "mask" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def diagnostics_skip_reason(spec: Any, params: Mapping[str, Any], kind: str | None,
                            backend: str = "torch") -> str | None:
    """Why the IS diagnostics are not computed for this configuration under ``kind``; None when they are.

    The providers of :attr:`~randattn.estimators.base.EstimatorSpec.importance_weights` describe the
    bidirectional estimator unless they declare the mask (``ImportanceWeights.masks``): weights that
    pool later keys would describe another estimator than the one measured, so under a mask they do
    not declare they are skipped (NaN), never computed bidirectionally.

    Parameters
    ----------
    spec : EstimatorSpec
    params : mapping
        The configuration's resolved parameters.
    kind : str or None
        The layer's mask kind.
    backend : {"torch", "reference"}
        The sweep's backend; the declared masks hold for the torch and the numpy providers alike.

    Returns
    -------
    str or None
        The reason, for the run's warnings and the report; None where the diagnostics are computed
        (or do not apply to the estimator at all, which the report explains on its own).
    """
    if kind is None or not spec.diagnostics_apply(params):
        return None
    if kind in spec.importance_weights.masks_of(params):
        return None
    return (f"IS diagnostics (ESS, delta-method variance, k-hat) not computed under mask={kind!r}: the importance-"
            f"weight provider of {spec.name!r} takes no mask, and bidirectional weights would describe another "
            "estimator")


# ------------------------------------------------------------------------------------------------ deprecated
def _warn_deprecated(name: str, replacement: str) -> None:
    warnings.warn(f"randattn.analysis.masking.{name} is deprecated; use {replacement} "
                  "(randattn.estimators.masks.Mask)", DeprecationWarning, stacklevel=3)


def mask_label(kind: str | None) -> str:
    """Deprecated: ``Mask.parse(kind).label`` (:attr:`~randattn.estimators.masks.Mask.label`)."""
    _warn_deprecated("mask_label", "Mask.parse(kind).label")
    return Mask.parse(kind).label


def sliding_window(kind: str | None) -> int | None:
    """Deprecated: ``Mask.parse(kind).window`` (:attr:`~randattn.estimators.masks.Mask.window`)."""
    _warn_deprecated("sliding_window", "Mask.parse(kind).window")
    return Mask.parse(kind).window


def visible_keys(kind: str | None, num_queries: int, num_keys: int) -> np.ndarray | None:
    """Deprecated: ``Mask.parse(kind).visible(num_queries, num_keys)``
    (:meth:`~randattn.estimators.masks.Mask.visible`)."""
    _warn_deprecated("visible_keys", "Mask.parse(kind).visible(num_queries, num_keys)")
    return Mask.parse(kind).visible(num_queries, num_keys)


def visible_key_counts(kind: str | None, num_queries: int, num_keys: int) -> np.ndarray:
    """Deprecated: ``Mask.parse(kind).visible_counts(num_queries, num_keys)``
    (:meth:`~randattn.estimators.masks.Mask.visible_counts`)."""
    _warn_deprecated("visible_key_counts", "Mask.parse(kind).visible_counts(num_queries, num_keys)")
    return Mask.parse(kind).visible_counts(num_queries, num_keys)


def estimator_mask_kwargs(kind: str | None) -> dict[str, Any]:
    """Deprecated: ``Mask.parse(kind).estimator_kwargs`` (:attr:`~randattn.estimators.masks.Mask.estimator_kwargs`)."""
    _warn_deprecated("estimator_mask_kwargs", "Mask.parse(kind).estimator_kwargs")
    return Mask.parse(kind).estimator_kwargs
