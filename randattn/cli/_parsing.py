"""``randattn mse``'s option parsing: text -> values, and every option checked before anything is computed.

Kept apart from :mod:`randattn.cli.mse` so that the command stays a thin click layer (its options and their help);
the parsers are also imported by the benchmarks.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

#: estimators run when none are named (those of them that are registered)
DEFAULT_ESTIMATORS = ("rfa", "lara", "ra", "eva")
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``"2GiB"``, ``"500MB"``, ``"1e9"`` or ``"1073741824"`` -> bytes; under
    :data:`~randattn.analysis.cell_memory.MIN_MAX_MEMORY` (no unit could ever run) refused, naming it."""
    from randattn.analysis.cell_memory import MIN_MAX_MEMORY, format_bytes

    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", str(text))
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f"--max-memory: cannot read {text!r}; use e.g. 2GiB, 500MB or a number of bytes")
    try:
        value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    except ValueError:
        raise ValueError(f"--max-memory: cannot read {text!r}; use e.g. 2GiB, 500MB or a number of bytes") from None
    if not value >= MIN_MAX_MEMORY:
        read = f" (read as {int(value)} bytes)" if value >= 0 and not match.group(2) else ""
        raise ValueError(f"--max-memory {text}{read} is below the least that one replicate of one head needs at "
                         f"the smallest shape; use at least {format_bytes(MIN_MAX_MEMORY)} (e.g. 16KiB; "
                         "2GiB or 500MB are typical)")
    return int(value)


def parse_int_list(name: str, text: str | None, example: str = "0,2,5-7") -> tuple[int, ...] | None:
    """``"0,2,5-7"`` -> ``(0, 2, 5, 6, 7)``; None stays None (all). ``example`` is the hint an unreadable item gets.

    An empty item (``"64,,256"``, ``"16,"``) is refused: a number left out by mistake would otherwise go unseen."""
    if text is None:
        return None
    values: list[int] = []
    items = [part.strip() for part in text.split(",")]
    if "" in items and any(items):
        raise ValueError(f"{name}: an empty item in {text!r} (two commas in a row, or one at an end); use integers "
                         f"and ranges like {example}")
    for item in filter(None, items):
        try:
            if re.fullmatch(r"\d+-\d+", item):
                lo, hi = map(int, item.split("-"))
                if hi < lo:
                    raise ValueError
                values.extend(range(lo, hi + 1))
            else:
                values.append(int(item))
        except ValueError:
            raise ValueError(f"{name}: cannot read {item!r} in {text!r}; use integers and ranges like "
                             f"{example}") from None
    if not values:
        raise ValueError(f"{name}: no values in {text!r}")
    return tuple(dict.fromkeys(values))


def parse_position_buckets(text: str | None):
    """``--position-buckets``: ``"auto"`` for None (the default), else what
    :func:`randattn.analysis.positions.parse_position_buckets` accepts; its ValueError names the option."""
    from randattn.analysis.positions import parse_position_buckets as parse

    if text is None:
        return "auto"
    return parse(text, name="--position-buckets")


def parse_queries(text: str | None) -> str:
    """``--queries``: ``"all"`` for None, else what :func:`randattn.analysis.queries.parse_query_selection` accepts."""
    from randattn.analysis.queries import parse_query_selection

    if text is None:
        return "all"
    try:
        return parse_query_selection(text)
    except ValueError:
        raise ValueError(f"--queries {text!r}: use all, last:K or sample:K with K a positive integer (e.g. "
                         "last:64)") from None


def parse_epsilon(value: float | None) -> float | None:
    """``--epsilon``: None, or a relative output error in (0, 1)."""
    from randattn.analysis.relative_error import check_epsilon

    if value is None:
        return None
    try:
        return check_epsilon(value)
    except (TypeError, ValueError):
        raise ValueError(f"--epsilon {value:g}: must be in (0, 1), a relative output error "
                         "||y_hat_n - y_n|| / ||y_n|| (e.g. 0.05)") from None


def resolve_mask(choice: str, activations: Any):
    """``--mask`` (one of :data:`~randattn.analysis.masking.MASK_CHOICES`, or ``sliding:W``): the kind of the mask it
    names for every layer (None, ``"causal"``, ``"sliding:W"``), or (``file``) the activation file's recorded masks
    (canonical form).

    A window that holds every key of the file's sequences is the causal mask, and is measured and recorded as such
    (as a capture no longer than a layer's window records it), with a note on stderr."""
    from randattn.analysis.masking import masks_of_activations
    from randattn.cli._common import abort, err_console
    from randattn.estimators.masks import Mask

    if choice != "file":
        mask = Mask.parse(choice, "--mask")
        tokens = int(activations.shape[2])
        if mask.name == "sliding" and mask.window >= tokens:
            err_console.print(f"--mask {choice}: a window of {mask.window} keys holds every key of these "
                              f"{tokens}-token sequences, so it is the causal mask: measured and recorded as causal",
                              highlight=False, markup=False, emoji=False)
            mask = Mask.parse("causal")
        replaced = _replaced_masks(activations, mask.kind)
        if replaced:
            err_console.print(f"--mask {choice} replaces the mask the file records for {replaced} (--mask file, the "
                              "default, measures each layer under its own)", highlight=False, markup=False, emoji=False,
                              soft_wrap=True)
        return mask.kind
    try:
        return masks_of_activations(activations)
    except ValueError as exc:
        abort(f"--mask file: {exc}")


def _replaced_masks(activations: Any, kind: str | None) -> str:
    """The layers whose recorded mask (the file's metadata 'mask') differs from ``kind``, in words (``"layer 0
    (sliding:512)"``, ``"layers 0, 2 (sliding:512) and 5 (none)"``, ``"every layer (causal)"``); empty where none
    does, or the file records none or records it unreadably (``--mask file`` says why then)."""
    from randattn.analysis.masking import masks_of_activations

    try:
        recorded = masks_of_activations(activations)
    except ValueError:
        return ""
    if recorded is None:
        return ""
    recorded = dict(recorded) if isinstance(recorded, tuple) else {layer: recorded for layer in activations.layers}
    differing: dict[str, list[int]] = {}
    for layer, own in recorded.items():
        if own != kind:
            differing.setdefault("none" if own is None else str(own), []).append(int(layer))
    parts = [f"{', '.join(map(str, layers))} ({own})" for own, layers in differing.items()]
    if not parts:
        return ""
    if len(differing) == 1 and len(recorded) > 1 and len(next(iter(differing.values()))) == len(recorded):
        return f"every layer ({next(iter(differing))})"
    noun = "layer" if sum(len(layers) for layers in differing.values()) == 1 else "layers"
    return f"{noun} " + (parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1])


def prepare(acts: Path, estimator_list, estimator_items, samples, replicates, layers, heads, images, seed, backend,
            device, dtype, check_reference, max_memory, probabilities, diagnostics, threads=None, mask_choice="file",
            position_buckets=None, queries=None, epsilon=None):
    """Parse and validate every option of ``randattn mse``; user errors exit 2 with a message.

    Returns
    -------
    (SweepConfig, Activations)
    """
    from randattn.activations import load_activations
    from randattn.analysis.memory import default_max_memory
    from randattn.analysis.plan import with_threads
    from randattn.analysis.plan import SweepConfig, parse_estimator_list
    from randattn._validation import check_positive_int
    from randattn.analysis.sweep_plan import count_cells
    from randattn.cli._common import abort
    from randattn.cli._errors import said
    from randattn.estimators.registry import list_estimators

    try:  # before the file is loaded: a budget nothing fits, a malformed selection or tolerance are refused at once
        memory = None if max_memory is None else parse_bytes(max_memory)
        selection = parse_queries(queries)
        tolerance = parse_epsilon(epsilon)
    except ValueError as exc:
        abort(str(exc))
    try:
        activations = load_activations(acts)
    except (OSError, ValueError, TypeError) as exc:
        abort(f"cannot read activations: {exc}")
    mask = resolve_mask(mask_choice, activations)
    count = None if selection == "all" else int(selection.split(":")[1])
    if count is not None and count > activations.shape[2]:
        abort(f"--queries {selection}: K = {count} is more than the {activations.shape[2]} queries per head of "
              f"{acts}; use K <= {activations.shape[2]}")
    texts = [t for t in ([estimator_list] if estimator_list else []) + list(estimator_items)]
    if not texts:
        available = list_estimators()
        texts = [";".join(name for name in DEFAULT_ESTIMATORS if name in available)]
    try:
        if backend == "torch":
            from randattn._validation import check_device

            check_device(device)
        elif device not in (None, "cpu"):
            raise ValueError(f"--device {device} needs --backend torch (the reference runs on the CPU)")
        if memory is None:  # once the device is known to exist
            memory = default_max_memory(device)
        check_positive_int("--replicates", replicates)
        if threads is not None:
            check_positive_int("--threads", threads)
        estimators = parse_estimator_list(texts)
        if replicates < 2 and any(e.random for e in estimators):
            raise ValueError(f"--replicates {replicates}: random estimators need at least 2 replicates for a variance")
        num_samples = parse_int_list("--samples", samples, example="16,64 or 4-8")
        if num_samples and min(num_samples) < 1:
            raise ValueError(f"--samples: every S must be >= 1 (samples per estimate), got {samples!r}")
        buckets = parse_position_buckets(position_buckets)
        config = SweepConfig(
            estimators=estimators, num_samples=num_samples, replicates=replicates, seed=seed, backend=backend,
            device=device, dtype=dtype, max_memory=memory, layers=parse_int_list("--layers", layers),
            heads=parse_int_list("--heads", heads), images=parse_int_list("--images", images),
            probabilities=probabilities, diagnostics=diagnostics, check_reference=check_reference,
            threads=threads, mask=mask, position_buckets=buckets, queries=selection, epsilon=tolerance,
        )
        config = with_threads(config)
    except (ValueError, TypeError) as exc:
        abort(said(exc))
    try:
        count_cells(activations, config)  # validates the selection and refuses estimators the masks exclude
    except (ValueError, TypeError) as exc:
        message = said(exc)
        if mask_choice == "file" and mask is not None and "mask" in message:
            message += (" (the mask is the activation file's own metadata 'mask'; --mask none, causal or "
                        "sliding:W overrides it)")
        abort(message)
    note = _own_epsilons_note(config)
    if note is not None:
        from randattn.cli._common import err_console

        err_console.print(note, highlight=False, markup=False, emoji=False, soft_wrap=True)
    return config, activations


def _own_epsilons_note(config) -> str | None:
    """With ``--epsilon``, where some estimators promise (epsilon, delta) of their own: those are checked at their
    own epsilon on the quantity their promise bounds, so the option does not reach them; None where it reaches
    every estimator (or is not given)."""
    from randattn.estimators.registry import get_spec

    if config.epsilon is None:
        return None
    own = {}
    for est in config.estimators:
        spec = get_spec(est.name)
        promise = spec.promise_of(spec.resolve_params(est.params))
        if promise is not None:
            own[est.label] = promise[0]
    if not own:
        return None
    theirs = "; ".join(f"{label}: {epsilon:g}" for label, epsilon in own.items())
    reach = ("applies to none of the estimators" if len(own) == len(config.estimators)
             else "applies to the estimators without a promise of their own")
    return (f"--epsilon {config.epsilon:g} {reach}: an estimator that promises (epsilon, delta) is checked at its "
            f"own epsilon, on the quantity its promise bounds ({theirs})")
