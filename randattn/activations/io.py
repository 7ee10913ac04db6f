"""Activation files: Q, K, V per layer as ``(images, heads, tokens, head_dim)`` arrays plus JSON metadata.

Layout (the same keys in every container)::

    layer{L}.q   (B, H, N, D)     queries of layer L, before any temperature scaling
    layer{L}.k   (B, Hkv, N, D)   keys (Hkv == H except in grouped-query attention)
    layer{L}.v   (B, Hkv, N, D)   values

Metadata is one JSON object. In ``.safetensors`` files it is the string metadata entry ``"randattn"``; in
``.npz`` files a 0-d string array and in ``.pt`` files (a ``dict`` saved with ``torch.save``) a ``str`` value,
both under the key ``"__metadata__"``. Only ``"scale"`` (the softmax temperature, logits are
``scale * q . k``) is required in files written by hand; the other fields (``model``, ``layers``, ``heads``,
``head_dim``, ``tokens``, ``images``, ``input_size``, ``source``, ``randattn_version``, ``dtype``) are filled in
from the arrays when absent and checked against them when present.

Optional fields, validated when present (files without them load exactly as before):

* ``grid`` ``[rows, columns]`` and ``prefix_tokens``: the patch grid of a ViT capture.
* ``layout``: ``"sequence"`` for a token sequence with no patch grid (decoder language models); such files carry
  no ``grid`` and raise no :class:`NoGridWarning`.
* ``kv_heads`` (int) and ``head_map`` (one int per query head): grouped-query attention. Keys and values are stored
  once per key/value head, ``(B, kv_heads, N, D)``; query head ``h`` attends with key/value head ``head_map[h]``
  (``h // (H // kv_heads)`` in every transformers model, as its ``repeat_kv`` does). A file whose k, v have fewer
  heads than q must say so with these fields. :meth:`Activations.qkv` expands k, v to the query heads by indexing;
  :meth:`Activations.stored_qkv` gives the arrays as stored.
* ``mask``: per layer, ``{"<layer>": kind}`` with kind ``null`` (every query sees every key), ``"causal"`` (key m
  visible to query n iff ``m <= n``) or ``"sliding:W"`` (iff ``n - W < m <= n``: each query sees itself and the
  W - 1 keys before it, the convention of transformers' sliding-window masks). A single kind is accepted for all
  layers and stored per layer.
* ``token_ids`` (one list of N ints per sequence) and ``token_strings`` (the same shape, the decoded text of each
  token, or null when the model came without a tokenizer): what a language-model capture was run on.

Language-model captures (:mod:`randattn.activations.lm`) also record ``architecture``, ``sliding_window`` (per
layer, the model's window or null), ``weights`` (e.g. "dequantised from Q4_1 GGUF": for GGUF models the
dequantised float32 weights are the model that was captured), ``add_bos`` and ``text``. Leading-axis entries are
named by ``images`` in every file (sequence names in a language-model capture).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import warnings
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from randattn._files import atomic_path

__all__ = [
    "Activations", "load_activations", "save_activations", "make_activations", "infer_grid", "NoGridWarning", "FORMATS",
]

#: file suffix -> container format
FORMATS: dict[str, str] = {".safetensors": "safetensors", ".npz": "npz", ".pt": "pt"}
#: where the JSON metadata lives: safetensors string-metadata key, and the key in .npz / .pt containers
SAFETENSORS_METADATA_KEY = "randattn"
METADATA_KEY = "__metadata__"
_KEY_PATTERN = re.compile(r"^layer(\d+)\.(q|k|v)$")
_DTYPES = {"float32": np.float32, "float16": np.float16}
_ALLOWED_STORED = (np.float16, np.float32, np.float64)
_MASK_PATTERN = re.compile(r"^sliding:([1-9]\d*)$")
#: values of the ``layout`` metadata field
LAYOUTS = ("sequence",)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("randattn")
    except PackageNotFoundError:  # running from a source tree that is not installed
        return "unknown"


@dataclass(frozen=True)
class Activations:
    """Captured queries, keys and values of several attention layers, with their metadata.

    Arrays are read-only. Build one with :func:`make_activations` (validates) or :func:`load_activations`.

    Attributes
    ----------
    arrays : dict[int, tuple[ndarray, ndarray, ndarray]]
        layer index -> ``(q, k, v)`` as stored: q ``(B, H, N, D)`` (images or sequences, heads, tokens, head_dim),
        k and v ``(B, Hkv, N, D)`` with ``Hkv == H`` unless the file records grouped-query attention
        (``kv_heads``, ``head_map``).
    metadata : dict
        JSON-serialisable description; always holds ``model``, ``layers``, ``heads``, ``head_dim``, ``scale``,
        ``tokens``, ``images``, ``input_size``, ``source``, ``randattn_version``, ``dtype``.
    """

    arrays: Mapping[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = field(repr=False)
    metadata: Mapping[str, Any]

    @property
    def layers(self) -> tuple[int, ...]:
        """Layer indices, ascending."""
        return tuple(sorted(self.arrays))

    @property
    def scale(self) -> float:
        """Softmax temperature: attention logits are ``scale * q . k``."""
        return float(self.metadata["scale"])

    @property
    def grid(self) -> tuple[int, int] | None:
        """Patch grid ``(rows, columns)`` of the tokens after the prefix, or None when the file does not say."""
        grid = self.metadata.get("grid")
        return None if grid is None else (int(grid[0]), int(grid[1]))

    @property
    def prefix_tokens(self) -> int:
        """Leading non-patch tokens (CLS, registers) before the patch grid; 0 when unknown."""
        return int(self.metadata.get("prefix_tokens") or 0)

    @property
    def layout(self) -> str | None:
        """``"sequence"`` for a language-model capture (tokens in text order, no patch grid); None otherwise."""
        return self.metadata.get("layout")

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(B, H, N, D)``: images, (query) heads, tokens, head_dim; :meth:`qkv` gives q, k, v all of this shape."""
        return tuple(self.arrays[self.layers[0]][0].shape)  # type: ignore[return-value]

    @property
    def images(self) -> tuple[str, ...]:
        """Names of the entries of the leading axis (images; sequences in a language-model capture)."""
        return tuple(self.metadata["images"])

    @property
    def kv_heads(self) -> int:
        """Number of stored key/value heads (equal to the query heads unless grouped-query attention)."""
        return int(self.arrays[self.layers[0]][1].shape[1])

    @property
    def head_map(self) -> tuple[int, ...]:
        """Query head ``h`` -> the key/value head it attends with (the identity without grouped-query attention)."""
        stored = self.metadata.get("head_map")
        return tuple(range(self.shape[1])) if stored is None else tuple(int(x) for x in stored)

    @cached_property
    def digest(self) -> str:
        """SHA-256 of every layer's q, k and v as stored (index, dtype, shape and bytes), hex: two captures with
        these shapes and metadata but other numbers differ here, which a resumed run compares (computed once; about
        1.9 GiB/s on the 2-core AVX-512 test machine)."""
        sha = hashlib.sha256()
        for layer in self.layers:
            for array in self.arrays[layer]:
                sha.update(f"{layer}:{array.dtype.str}:{array.shape};".encode())
                sha.update(memoryview(np.ascontiguousarray(array)).cast("B"))
        return sha.hexdigest()

    def kv_head(self, head: int) -> int:
        """The stored key/value head that query head ``head`` uses (``head_map[head]``)."""
        heads = self.shape[1]
        if isinstance(head, bool) or not isinstance(head, (int, np.integer)) or not -heads <= head < heads:
            raise IndexError(f"head {head!r} is out of range; these activations have {heads} query heads")
        return self.head_map[int(head)]

    def mask(self, layer: int) -> str | None:
        """Attention mask of ``layer``: None (none), ``"causal"`` or ``"sliding:W"`` (module docstring)."""
        if layer not in self.arrays:
            raise KeyError(f"layer {layer!r} is not in these activations (layers: {list(self.layers)})")
        masks = self.metadata.get("mask")
        return None if masks is None else masks.get(str(layer))

    def q(self, layer: int) -> np.ndarray:
        """Queries of ``layer``, shape ``(B, H, N, D)``."""
        return self.stored_qkv(layer)[0]

    def k(self, layer: int) -> np.ndarray:
        """Keys of ``layer`` per query head, shape ``(B, H, N, D)`` (see :meth:`qkv`)."""
        return self.qkv(layer)[1]

    def v(self, layer: int) -> np.ndarray:
        """Values of ``layer`` per query head, shape ``(B, H, N, D)`` (see :meth:`qkv`)."""
        return self.qkv(layer)[2]

    def qkv(self, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(q, k, v)`` of ``layer``, each ``(B, H, N, D)``: entry ``[:, h]`` of k and v is what query head h uses.

        Without grouped-query attention these are the stored arrays themselves. With it, k and v are gathered
        from the stored key/value heads through :attr:`head_map` on each call (a read-only copy, never stored),
        so code that indexes q, k, v by the same head stays right; use :meth:`layer_qkv` to gather only a few heads.
        """
        q, k, v = self.stored_qkv(layer)
        if k.shape[1] == q.shape[1] and self.head_map == tuple(range(q.shape[1])):
            return q, k, v
        index = np.asarray(self.head_map, dtype=np.intp)
        return q, _read_only(np.take(k, index, axis=1)), _read_only(np.take(v, index, axis=1))

    def stored_qkv(self, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(q, k, v)`` of ``layer`` as stored: q ``(B, H, N, D)``, k and v ``(B, kv_heads, N, D)``."""
        if layer not in self.arrays:
            raise KeyError(f"layer {layer!r} is not in these activations (layers: {list(self.layers)})")
        return self.arrays[layer]

    def layer_qkv(
        self, layer: int, heads: Sequence[int] | None = None, image: int | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """q, k, v of some query heads of ``layer``, k and v taken from each head's key/value head.

        Parameters
        ----------
        layer : int
        heads : sequence of int, optional
            Query heads (default all); negative indices count from the end.
        image : int, optional
            One entry of the leading axis (an image or sequence); default all.

        Returns
        -------
        tuple of ndarray
            ``(q, k, v)``, each ``(len(heads), N, D)`` for one ``image`` or ``(B, len(heads), N, D)``; row ``j``
            of k and v is the stored key/value head ``head_map[heads[j]]`` (gathered by indexing: new arrays,
            nothing is repeated in storage; heads that are consecutive stored heads are read-only views, no copy).

        Raises
        ------
        KeyError
            ``layer`` is not in the file.
        IndexError
            A head or image out of range.
        """
        q, k, v = self.stored_qkv(layer)
        count, total = q.shape[1], q.shape[0]
        chosen = list(range(count)) if heads is None else [_index(h, count) for h in heads]
        kv = np.asarray([self.head_map[h] for h in chosen], dtype=np.intp)
        qi = np.asarray(chosen, dtype=np.intp)
        if image is not None:
            b = _index(image, total, what="image")
            q, k, v = q[b], k[b], v[b]
        return _take_heads(q, qi), _take_heads(k, kv), _take_heads(v, kv)

    def nbytes(self) -> int:
        """Bytes held by the stored arrays."""
        return sum(a.nbytes for trio in self.arrays.values() for a in trio)


def _take_heads(a: np.ndarray, heads: np.ndarray) -> np.ndarray:
    """``np.take(a, heads, axis=-3)``, as a view where ``heads`` are consecutive (a long context's k and v are
    hundreds of MiB per layer: a copy would double what a unit holds)."""
    if len(heads) and np.array_equal(heads, np.arange(heads[0], heads[0] + len(heads))):
        return _read_only(a[..., heads[0]:heads[0] + len(heads), :, :])
    return np.take(a, heads, axis=-3)


def _read_only(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


def _index(i: Any, size: int, what: str = "head") -> int:
    if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not -size <= i < size:
        raise IndexError(f"{what} {i!r} is out of range; these activations have {size} {what}s")
    return int(i) % size


def make_activations(
    arrays: Mapping[int, tuple[np.ndarray, np.ndarray, np.ndarray]] | Mapping[str, np.ndarray],
    metadata: Mapping[str, Any],
    *,
    where: str = "arrays",
) -> Activations:
    """Validate arrays and metadata and build an :class:`Activations`.

    Parameters
    ----------
    arrays : dict
        Either layer -> ``(q, k, v)`` or the flat file layout ``"layer{L}.q"`` -> array; floating point, finite;
        every q ``(B, H, N, D)`` and every k and v ``(B, Hkv, N, D)`` with ``Hkv == H`` unless the metadata
        declares grouped-query attention (``kv_heads`` / ``head_map``, module docstring).
    metadata : dict
        Must hold ``"scale"`` (positive, finite). Missing descriptive fields are filled from the arrays;
        present ones must agree with them.
    where : str
        Names the source in error messages (e.g. the file path).

    Returns
    -------
    Activations

    Raises
    ------
    ValueError
        Naming the key, layer and shapes at fault.
    """
    per_layer = _group_by_layer(arrays, where)
    meta = _check_metadata(dict(metadata), per_layer, where)
    frozen = {}
    for layer, trio in per_layer.items():
        views = []
        for a in trio:
            a = np.ascontiguousarray(a)
            a.setflags(write=False)
            views.append(a)
        frozen[layer] = tuple(views)
    return Activations(arrays=frozen, metadata=meta)


def _group_by_layer(arrays: Mapping, where: str) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    if not isinstance(arrays, Mapping) or len(arrays) == 0:
        raise ValueError(f"{where}: no activations found (expected keys 'layer{{L}}.q', 'layer{{L}}.k', 'layer{{L}}.v')")
    grouped: dict[int, dict[str, np.ndarray]] = {}
    for key, value in arrays.items():
        if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
            if not isinstance(value, (tuple, list)) or len(value) != 3:
                raise ValueError(f"{where}: layer {key} must map to a (q, k, v) triple")
            grouped[int(key)] = dict(zip("qkv", value))
            continue
        match = _KEY_PATTERN.match(str(key))
        if match is None:
            raise ValueError(
                f"{where}: unexpected key {key!r}; keys must look like 'layer{{L}}.q', 'layer{{L}}.k', 'layer{{L}}.v'"
            )
        grouped.setdefault(int(match.group(1)), {})[match.group(2)] = value
    result = {}
    # q of every layer shares one shape; k and v share one shape that may differ from q's in the heads axis only
    # (grouped-query attention stores keys and values once per key/value head; the metadata check then requires
    # 'kv_heads'/'head_map' to say so)
    reference: tuple[str, tuple[int, ...]] | None = None
    reference_kv: tuple[str, tuple[int, ...]] | None = None
    for layer in sorted(grouped):
        parts = grouped[layer]
        missing = [f"layer{layer}.{name}" for name in "qkv" if name not in parts]
        if missing:
            raise ValueError(f"{where}: missing key(s) {missing} for layer {layer}")
        trio = []
        for name in "qkv":
            key = f"layer{layer}.{name}"
            a = np.asarray(parts[name])
            if a.dtype.type not in _ALLOWED_STORED:
                raise ValueError(f"{where}: {key} has dtype {a.dtype}; expected float16, float32 or float64")
            if a.ndim != 4:
                raise ValueError(
                    f"{where}: {key} has shape {a.shape}; expected 4 dims (images, heads, tokens, head_dim)"
                )
            if min(a.shape) == 0:
                raise ValueError(f"{where}: {key} has an empty dimension, shape {a.shape}")
            if reference is None:
                reference = (key, a.shape)
            elif name == "q" and a.shape != reference[1]:
                raise ValueError(
                    f"{where}: {key} has shape {a.shape} but {reference[0]} has shape {reference[1]}; "
                    "q, k and v of every layer must share one (images, heads, tokens, head_dim) shape"
                )
            elif name != "q" and (a.shape[0], *a.shape[2:]) != (reference[1][0], *reference[1][2:]):
                raise ValueError(
                    f"{where}: {key} has shape {a.shape} but {reference[0]} has shape {reference[1]}; "
                    "q, k and v of every layer must share one (images, heads, tokens, head_dim) shape "
                    "(k and v may have fewer heads: grouped-query attention)"
                )
            elif name != "q" and reference_kv is not None and a.shape != reference_kv[1]:
                raise ValueError(
                    f"{where}: {key} has shape {a.shape} but {reference_kv[0]} has shape {reference_kv[1]}; "
                    "k and v of every layer must share one (images, kv_heads, tokens, head_dim) shape"
                )
            if name != "q" and reference_kv is None:
                reference_kv = (key, a.shape)
            if not np.isfinite(a).all():
                bad = int(np.size(a) - np.count_nonzero(np.isfinite(a)))
                raise ValueError(f"{where}: {key} holds {bad} non-finite value(s) (NaN or inf)")
            trio.append(a)
        result[layer] = tuple(trio)
    return result


def _check_metadata(meta: dict, per_layer: dict, where: str) -> dict:
    if "scale" not in meta:
        raise ValueError(f"{where}: metadata has no 'scale' (the softmax temperature, e.g. head_dim ** -0.5)")
    try:
        scale = float(meta["scale"])
    except (TypeError, ValueError):
        raise ValueError(f"{where}: metadata 'scale' must be a number, got {meta['scale']!r}") from None
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{where}: metadata 'scale' must be positive and finite, got {scale!r}")
    first = next(iter(per_layer.values()))[0]
    images, heads, tokens, head_dim = first.shape
    derived = {
        "layers": sorted(per_layer),
        "heads": heads,
        "head_dim": head_dim,
        "tokens": tokens,
    }
    for name, value in derived.items():
        if name in meta and meta[name] is not None and _normalise(meta[name]) != value:
            raise ValueError(f"{where}: metadata {name!r} is {meta[name]!r} but the arrays give {value!r}")
        meta[name] = value
    names = meta.get("images")
    if names is None:
        names = [f"image{i}" for i in range(images)]
    if not isinstance(names, (list, tuple)) or len(names) != images:
        raise ValueError(f"{where}: metadata 'images' must list {images} name(s) (one per image), got {names!r}")
    meta["images"] = [str(n) for n in names]
    meta["scale"] = scale
    meta.setdefault("model", "unknown")
    meta.setdefault("input_size", None)
    meta.setdefault("source", "unknown")
    meta.setdefault("randattn_version", _version())
    meta["dtype"] = str(first.dtype)
    _check_layout(meta, tokens, where)
    _check_heads(meta, per_layer, where)
    _check_masks(meta, sorted(per_layer), where)
    _check_token_ids(meta, images, tokens, where)
    return meta


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _check_heads(meta: dict, per_layer: dict, where: str) -> None:
    """Validate ``kv_heads`` / ``head_map`` against the arrays (module docstring); fill ``head_map`` if missing."""
    layer = min(per_layer)
    heads, kv = per_layer[layer][0].shape[1], per_layer[layer][1].shape[1]
    kv_heads, head_map = meta.get("kv_heads"), meta.get("head_map")
    if kv_heads is None and head_map is None:
        if kv != heads:
            raise ValueError(
                f"{where}: layer{layer}.k has {kv} head(s) but layer{layer}.q has {heads}; a file whose keys and "
                "values have fewer heads than its queries (grouped-query attention) must say which key/value head "
                "each query head uses with metadata 'kv_heads' and 'head_map'"
            )
        return  # a file from before grouped-query attention: nothing to add
    if kv_heads is not None and (not _is_int(kv_heads) or int(kv_heads) != kv):
        raise ValueError(f"{where}: metadata 'kv_heads' is {kv_heads!r} but layer{layer}.k has {kv} head(s)")
    meta["kv_heads"] = kv
    if head_map is None:
        if heads % kv:
            raise ValueError(
                f"{where}: {heads} query heads do not split evenly over {kv} key/value heads; give 'head_map'"
            )
        head_map = [h // (heads // kv) for h in range(heads)]
    if not isinstance(head_map, (list, tuple)) or len(head_map) != heads:
        raise ValueError(
            f"{where}: metadata 'head_map' must list {heads} key/value head indices (one per query head), "
            f"got {head_map!r}"
        )
    bad = [x for x in head_map if not _is_int(x) or not 0 <= x < kv]
    if bad:
        raise ValueError(
            f"{where}: metadata 'head_map' holds {bad[0]!r}, which is not a key/value head index in [0, {kv})"
        )
    meta["head_map"] = [int(x) for x in head_map]


def _check_masks(meta: dict, layers: list[int], where: str) -> None:
    """Validate ``mask`` (module docstring), normalising it to ``{"<layer>": kind}``."""
    if meta.get("mask") is None:
        return
    mask = meta["mask"]
    if isinstance(mask, str):
        mask = {str(layer): mask for layer in layers}
    if not isinstance(mask, Mapping):
        raise ValueError(f"{where}: metadata 'mask' must map each layer to a mask kind, got {mask!r}")
    keys = sorted(str(k) for k in mask)
    if keys != sorted(str(layer) for layer in layers):
        raise ValueError(
            f"{where}: metadata 'mask' names layers {keys} but the arrays hold layers {layers}; give one mask kind "
            "per layer"
        )
    out: dict[str, str | None] = {}
    for key, kind in mask.items():
        if kind is not None and (not isinstance(kind, str) or (kind != "causal" and not _MASK_PATTERN.match(kind))):
            raise ValueError(
                f"{where}: metadata 'mask' of layer {key} is {kind!r}; expected null, 'causal' or 'sliding:W' "
                "(W a positive integer)"
            )
        out[str(key)] = kind
    meta["mask"] = {str(layer): out[str(layer)] for layer in layers}


def _check_token_ids(meta: dict, sequences: int, tokens: int, where: str) -> None:
    """Validate ``token_ids`` / ``token_strings``: one row of ``tokens`` entries per sequence."""
    for name, ok in (("token_ids", lambda x: _is_int(x) and x >= 0), ("token_strings", lambda x: isinstance(x, str))):
        rows = meta.get(name)
        if rows is None:
            continue
        shaped = isinstance(rows, (list, tuple)) and len(rows) == sequences and all(
            isinstance(row, (list, tuple)) and len(row) == tokens for row in rows)
        if not shaped:
            raise ValueError(
                f"{where}: metadata {name!r} must hold {sequences} row(s) of {tokens} entries (one per token of "
                "each sequence)"
            )
        if not all(ok(x) for row in rows for x in row):
            what = "non-negative integers" if name == "token_ids" else "strings"
            raise ValueError(f"{where}: metadata {name!r} must hold {what}")


class NoGridWarning(UserWarning):
    """Activations without a recorded patch grid: estimators fall back to 1-D (sequence) windows."""


_warned_no_grid = False


def _check_layout(meta: dict, tokens: int, where: str) -> None:
    """Validate ``layout``, ``grid`` / ``prefix_tokens`` (module docstring), normalising ``grid`` to ``[h, w]``."""
    layout = meta.get("layout")
    if layout is not None and layout not in LAYOUTS:
        raise ValueError(f"{where}: metadata 'layout' must be one of {list(LAYOUTS)} or absent, got {layout!r}")
    if layout == "sequence" and meta.get("grid") is not None:
        raise ValueError(f"{where}: metadata 'layout' is 'sequence' (no patch grid) but 'grid' is {meta['grid']!r}")
    prefix = meta.get("prefix_tokens")
    if prefix is not None:
        if isinstance(prefix, bool) or not isinstance(prefix, (int, np.integer)) or not 0 <= prefix <= tokens:
            raise ValueError(
                f"{where}: metadata 'prefix_tokens' must be an integer in [0, tokens={tokens}] (CLS and register "
                f"tokens before the patches), got {prefix!r}"
            )
        meta["prefix_tokens"] = int(prefix)
    grid = meta.get("grid")
    if grid is None:
        return
    ok = isinstance(grid, (list, tuple)) and len(grid) == 2
    ok = ok and all(isinstance(a, (int, np.integer)) and not isinstance(a, bool) and a >= 1 for a in grid)
    if not ok:
        raise ValueError(f"{where}: metadata 'grid' must be [rows, columns] of positive integers, got {grid!r}")
    if prefix is None:
        raise ValueError(
            f"{where}: metadata 'grid' is {list(grid)!r} but 'prefix_tokens' is missing; say how many tokens "
            "(CLS, registers) come before the patch grid"
        )
    h, w = int(grid[0]), int(grid[1])
    if meta["prefix_tokens"] + h * w != tokens:
        raise ValueError(
            f"{where}: metadata 'grid' {[h, w]} and 'prefix_tokens' {meta['prefix_tokens']} give "
            f"{meta['prefix_tokens']} + {h}*{w} = {meta['prefix_tokens'] + h * w} tokens, but the arrays have {tokens}"
        )
    meta["grid"] = [h, w]


def infer_grid(tokens: int, prefix_tokens: int = 1) -> tuple[int, tuple[int, int]] | None:
    """The square-grid reading of ``tokens``: ``(prefix_tokens, (s, s))`` when ``tokens - prefix_tokens = s^2``.

    An explicit option for files without a recorded grid (:class:`NoGridWarning`), never applied silently:
    a ViT with one CLS token on a square image has ``1 + s^2`` tokens (197 = 1 + 14^2, 785 = 1 + 28^2).
    Returns None when ``tokens - prefix_tokens`` is not a positive perfect square (e.g. register tokens or a
    non-square image: record the grid at capture instead).

    Examples
    --------
    >>> infer_grid(197), infer_grid(785), infer_grid(200), infer_grid(196, prefix_tokens=0)
    ((1, (14, 14)), (1, (28, 28)), None, (0, (14, 14)))
    """
    body = int(tokens) - int(prefix_tokens)
    if body < 1 or prefix_tokens < 0:
        return None
    side = math.isqrt(body)
    return (int(prefix_tokens), (side, side)) if side * side == body else None


def _normalise(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [int(x) for x in value]
    return int(value)


# ----------------------------------------------------------------------------------------------------------- writing
def save_activations(acts: Activations, path: str | os.PathLike, *, dtype: str | None = None) -> Path:
    """Write ``acts`` to ``path`` atomically (temporary file in the same folder, then ``os.replace``).

    Parameters
    ----------
    acts : Activations
    path : str or PathLike
        Ends in ``.safetensors`` (recommended), ``.npz`` or ``.pt``.
    dtype : {"float32", "float16"} or None
        Storage dtype; None keeps the arrays' dtype.

    Returns
    -------
    Path
        The written file.

    Raises
    ------
    ValueError
        Unknown suffix or dtype, or values that overflow float16.
    OSError
        The write failed (e.g. ``ENOSPC``, a full disk); its ``filename`` is ``path``, which is left as it was.
    """
    path, fmt, target = _save_iv(acts, path, dtype)
    flat: dict[str, np.ndarray] = {}
    for layer in acts.layers:
        for name, a in zip("qkv", acts.stored_qkv(layer)):  # k, v once per key/value head, as stored
            if target is not None and np.abs(a).max() > np.finfo(target).max:
                raise ValueError(
                    f"dtype: layer{layer}.{name} overflows {np.dtype(target).name} "
                    f"(max |x| = {float(np.abs(a).max()):.4g} > {float(np.finfo(target).max):.4g})"
                )
            stored = np.ascontiguousarray(a, dtype=target) if target is not None else np.ascontiguousarray(a)
            flat[f"layer{layer}.{name}"] = stored
    meta = dict(acts.metadata)
    meta["dtype"] = str(next(iter(flat.values())).dtype)
    text = json.dumps(meta, sort_keys=True)

    try:
        with atomic_path(path) as tmp:
            tmp_name = str(tmp)
            if fmt == "safetensors":
                from safetensors.numpy import save_file

                save_file(flat, tmp_name, metadata={SAFETENSORS_METADATA_KEY: text})
            elif fmt == "npz":
                with open(tmp_name, "wb") as fh:
                    np.savez(fh, **flat, **{METADATA_KEY: np.array(text)})
            else:
                import io

                import torch

                # serialised in memory first: torch's writer turns a failed write (a full disk) into a
                # RuntimeError that no longer says why; Python's own write keeps the OSError
                buffer = io.BytesIO()
                torch.save({**{k: torch.from_numpy(v.copy()) for k, v in flat.items()}, METADATA_KEY: text}, buffer)
                with open(tmp_name, "wb") as fh:
                    fh.write(buffer.getbuffer())
    except OSError as exc:
        # the error names the temporary file (or nothing); the caller wrote ``path``, which is left as it was
        raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from exc
    except Exception as exc:
        code = _os_error_code(exc)
        if code is None:
            raise
        raise OSError(code, os.strerror(code), str(path)) from exc
    return path


def _os_error_code(exc: BaseException) -> int | None:
    """The errno of a failed write that a Rust writer (safetensors' ``SafetensorError``) reports in its text only."""
    match = re.search(r"os error (\d+)", str(exc))
    return int(match.group(1)) if match else None


def _save_iv(acts: Any, path: Any, dtype: Any) -> tuple[Path, str, Any]:
    if not isinstance(acts, Activations):
        raise TypeError(f"acts must be an Activations, got {type(acts).__name__}")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or PathLike, got {type(path).__name__}")
    path = Path(path)
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(f"path: unknown suffix {path.suffix!r} in {str(path)!r}; use one of {sorted(FORMATS)}")
    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or None, got {dtype!r}")
    return path, fmt, (_DTYPES[dtype] if dtype is not None else None)


# ----------------------------------------------------------------------------------------------------------- reading
def load_activations(path: str | os.PathLike) -> Activations:
    """Read and validate an activation file (``.safetensors``, ``.npz`` or ``.pt``).

    Parameters
    ----------
    path : str or PathLike

    Returns
    -------
    Activations
        Arrays ``(B, H, N, D)`` in the stored dtype, read-only.

    Raises
    ------
    FileNotFoundError
        No such file.
    ValueError
        Unknown suffix, unreadable file, bad metadata JSON, missing or unexpected keys, shape disagreements,
        non-finite values, a scale that is not positive.
    """
    path = _load_iv(path)
    fmt = FORMATS[path.suffix.lower()]
    where = str(path)
    try:
        if fmt == "safetensors":
            arrays, text = _read_safetensors(path)
        elif fmt == "npz":
            arrays, text = _read_npz(path)
        else:
            arrays, text = _read_pt(path)
    except (OSError, ValueError, RuntimeError, EOFError) as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise ValueError(f"{where}: cannot read as {fmt}: {exc}") from exc
    except Exception as exc:  # container libraries raise their own types on corrupt input
        if type(exc).__name__ in ("SafetensorError", "BadZipFile", "UnpicklingError"):
            raise ValueError(f"{where}: cannot read as {fmt}: {exc}") from exc
        raise
    if text is None:
        raise ValueError(
            f"{where}: no metadata found (store a JSON string with at least 'scale' under {METADATA_KEY!r}, "
            f"or the safetensors metadata key {SAFETENSORS_METADATA_KEY!r})"
        )
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: metadata is not valid JSON: {exc}") from exc
    if not isinstance(meta, dict):
        raise ValueError(f"{where}: metadata must be a JSON object, got {type(meta).__name__}")
    acts = make_activations(arrays, meta, where=where)
    global _warned_no_grid
    if acts.grid is None and acts.layout != "sequence" and not _warned_no_grid:
        _warned_no_grid = True
        warnings.warn(
            f"{where}: no patch 'grid' in the metadata, nor layout 'sequence', so the token layout is unknown; "
            "estimators use 1-D (sequence) windows. For ViT patch tokens add 'grid' [rows, columns] and "
            "'prefix_tokens' to the metadata (randattn.activations.io.infer_grid gives the square-grid reading); "
            "for text add \"layout\": \"sequence\". Said once per process.",
            NoGridWarning,
            stacklevel=2,
        )
    return acts


def _load_iv(path: Any) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or PathLike, got {type(path).__name__}")
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"activation file not found: {str(path)!r}")
    if not path.is_file():
        raise ValueError(f"activation file {str(path)!r} is not a file")
    if path.suffix.lower() not in FORMATS:
        results = (" (a results table: randattn report and randattn plot read it)"
                   if path.suffix.lower() in (".parquet", ".csv", ".json") else "")
        raise ValueError(f"activation file {str(path)!r}: unknown suffix {path.suffix!r}{results}; activations are "
                         f"one of {sorted(FORMATS)}")
    return path


def _read_safetensors(path: Path) -> tuple[dict[str, np.ndarray], str | None]:
    from safetensors import safe_open

    with safe_open(str(path), framework="np") as fh:
        meta = fh.metadata() or {}
        arrays = {key: fh.get_tensor(key) for key in fh.keys()}
    return arrays, meta.get(SAFETENSORS_METADATA_KEY)


def _read_npz(path: Path) -> tuple[dict[str, np.ndarray], str | None]:
    import zipfile

    if not zipfile.is_zipfile(path):
        # np.load would take any other file for a pickle and advise loading it unsafely
        raise ValueError("it is not an .npz archive (a zip of .npy arrays, as numpy.savez writes)")
    with np.load(path, allow_pickle=False) as data:
        arrays = {key: data[key] for key in data.files}
    text = arrays.pop(METADATA_KEY, None)
    return arrays, (str(text[()]) if text is not None else None)


def _read_pt(path: Path) -> tuple[dict[str, np.ndarray], str | None]:
    import torch

    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch's unpickler refusing a non-tensor object: keep its first plain line
        if "weights_only" in str(exc) or type(exc).__name__ == "UnpicklingError":
            raise ValueError("it holds objects other than tensors and strings (loaded with weights_only=True, "
                             "which refuses arbitrary pickled code); save a dict of tensors") from None
        raise
    if not isinstance(data, dict):
        raise ValueError(f"expected a dict of tensors, got {type(data).__name__}")
    text = data.pop(METADATA_KEY, None)
    if text is not None and not isinstance(text, str):
        raise ValueError(f"{METADATA_KEY!r} must be a JSON string, got {type(text).__name__}")
    arrays = {}
    for key, value in data.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"key {key!r} holds a {type(value).__name__}, not a tensor")
        if value.dtype in (torch.bfloat16, torch.float16):
            value = value.float()  # numpy has no bfloat16; float16 -> float32 too, exactly (upcasts are exact)
        try:
            arrays[key] = value.detach().numpy()
        except (TypeError, RuntimeError) as exc:
            raise ValueError(f"key {key!r} has dtype {value.dtype}, which cannot be read ({exc})") from None
    return arrays, text
