r"""Sweeps: estimators x parameter variants x sample counts x replicates over an activation set.

One **cell** is one (image, layer, head) input with one estimator configuration and one sample
count S; it yields one row of the tidy table (:data:`COLUMNS`). Cells of the same (layer,
estimator, S) are evaluated together as a batch ``(C,)`` by the estimator's reference (numpy
float64) or batched (torch) form, vectorized over the R replicates, in chunks whose size is
set by a memory budget.

Reproducibility
---------------
Each cell's seed is derived from the master seed and the cell's identity alone
(:func:`cell_seed`), and replicate r of a cell draws from
``np.random.default_rng(np.random.SeedSequence(cell_seed, spawn_key=(r,)))``. Results are
therefore independent of chunk sizes, memory budget, the order cells are run in, and of an
interruption: a resumed sweep gives the same table as an uninterrupted one.

Persistence
-----------
With ``parts_dir`` set, every finished chunk is written atomically as a CSV part file
(floats round-trip exactly) next to a ``manifest.json`` that records the configuration;
``resume=True`` reads the parts, skips the cells they hold and runs the rest.
:func:`consolidate` returns the canonical, sorted table.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
import tracemalloc
from dataclasses import dataclass, field

from randattn._files import atomic_path, atomic_write_text
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from randattn._validation import check_choice, check_positive_int
from randattn.analysis.diagnostics import estimator_diagnostics, nan_diagnostics
from randattn.analysis.metrics import probability_mse, relative_error, replicate_metrics
from randattn.estimators.base import Draws

__all__ = [
    "COLUMNS",
    "EstimatorConfig",
    "SweepConfig",
    "SweepProgress",
    "estimator_config",
    "parse_estimator_list",
    "cell_seed",
    "replicate_rng",
    "run_sweep",
    "read_parts",
    "consolidate",
    "aggregate",
    "as_activations",
    "count_cells",
    "write_table",
    "table_records",
]

#: the sweep table's columns, in order (plotting code relies on these names)
COLUMNS: tuple[str, ...] = (
    "model", "image", "layer", "head", "tokens", "estimator", "params", "label", "num_samples", "replicates",
    "random", "mse", "mse_se", "variance", "bias_sq", "bias_sq_naive", "bias_sq_se", "rel_error", "prob_mse",
    "ess_mean", "delta_var_ratio", "pareto_khat", "seconds", "seed",
)
_STR_COLUMNS = ("model", "image", "estimator", "params", "label")
_INT_COLUMNS = ("layer", "head", "tokens", "num_samples", "replicates", "seed")
_BOOL_COLUMNS = ("random",)
_FLOAT_COLUMNS = tuple(c for c in COLUMNS if c not in _STR_COLUMNS + _INT_COLUMNS + _BOOL_COLUMNS)
BACKENDS = ("reference", "torch")
DTYPES = ("float32", "float64")


# ------------------------------------------------------------------------------------------ estimator configurations
@dataclass(frozen=True)
class EstimatorConfig:
    """One estimator with resolved parameters.

    Attributes
    ----------
    name : str
        Registry name.
    params : dict
        Every parameter, defaults filled in (``spec.resolve_params``).
    label : str
        ``name`` when all parameters are defaults, else ``name:p=v,...`` listing the non-default
        ones in the spec's parameter order (e.g. ``rfa:coupling=orthogonal``).
    params_json : str
        Canonical JSON of ``params`` (sorted keys, no spaces).
    random : bool
        ``spec.is_random(params)``.
    needs_samples : bool
        Whether S matters; S-free estimators (softmax, local) are run once and reported at every S.
    """

    name: str
    params: Mapping[str, Any] = field(hash=False, compare=False)
    label: str
    params_json: str
    random: bool
    needs_samples: bool


def estimator_config(name: str, params: Mapping[str, Any] | None = None) -> EstimatorConfig:
    """Resolve ``name`` (optionally ``"name:p=v,..."``) and ``params`` into an :class:`EstimatorConfig`.

    Raises
    ------
    ValueError
        Unknown estimator or parameter, or a disallowed value (message from the registry).
    """
    from randattn.estimators.registry import get_spec, parse_estimator

    parsed_name, parsed = parse_estimator(name)
    given = {**parsed, **dict(params or {})}
    spec = get_spec(parsed_name)
    resolved = spec.resolve_params(given)
    non_default = [f"{p}={_fmt(resolved[p])}" for p, param in spec.params.items() if resolved[p] != param.default]
    label = parsed_name + (":" + ",".join(non_default) if non_default else "")
    return EstimatorConfig(
        name=parsed_name,
        params=resolved,
        label=label,
        params_json=json.dumps(resolved, sort_keys=True, separators=(",", ":"), default=str),
        random=bool(spec.is_random(resolved)),
        needs_samples=bool(spec.needs_samples),
    )


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def parse_estimator_list(texts: str | Iterable[str]) -> tuple[EstimatorConfig, ...]:
    """Parse ``"rfa:coupling=orthogonal;ra"`` (``;``-separated) or several such strings.

    Duplicates (same label) are dropped, keeping the first.
    """
    if isinstance(texts, str):
        texts = [texts]
    configs: list[EstimatorConfig] = []
    for text in texts:
        for item in filter(None, (part.strip() for part in str(text).split(";"))):
            config = estimator_config(item)
            if config.label not in {c.label for c in configs}:
                configs.append(config)
    if not configs:
        raise ValueError("no estimators given (e.g. 'rfa;ra' or 'rfa:coupling=orthogonal')")
    return tuple(configs)


# ---------------------------------------------------------------------------------------------------- sweep config
@dataclass(frozen=True)
class SweepConfig:
    """What to run.

    Attributes
    ----------
    estimators : tuple of EstimatorConfig
    num_samples : tuple of int
        Sample counts S.
    replicates : int
        R for random estimators (deterministic ones use 1).
    seed : int
        Master seed (non-negative).
    backend : {"reference", "torch"}
    device : str or None
        torch device (``"cuda"``, ``"cpu"``); torch backend only.
    dtype : {"float32", "float64"}
        torch dtype; the reference is always float64.
    max_memory : int
        Approximate peak bytes of one chunk (see :func:`run_sweep`).
    layers, heads, images : tuple of int or None
        Layer ids, head indices and image indices to run; None for all.
    probabilities : bool
        Also measure the MSE of the implied attention probabilities (costs an extra
        estimator call with ``v = I_M``).
    diagnostics : bool
        Importance-sampling diagnostics where available (:mod:`randattn.analysis.diagnostics`).
    khat_queries : int
        Queries per cell on which Pareto k-hat is fitted.
    """

    estimators: tuple[EstimatorConfig, ...]
    num_samples: tuple[int, ...]
    replicates: int = 16
    seed: int = 0
    backend: str = "reference"
    device: str | None = None
    dtype: str = "float32"
    max_memory: int = 2**30
    layers: tuple[int, ...] | None = None
    heads: tuple[int, ...] | None = None
    images: tuple[int, ...] | None = None
    probabilities: bool = True
    diagnostics: bool = True
    khat_queries: int = 16

    def __post_init__(self) -> None:
        if not self.estimators or not all(isinstance(e, EstimatorConfig) for e in self.estimators):
            raise TypeError("estimators must be a non-empty tuple of EstimatorConfig (see estimator_config)")
        if not self.num_samples:
            raise ValueError("num_samples must list at least one sample count")
        for s in self.num_samples:
            check_positive_int("num_samples", s)
        check_positive_int("replicates", self.replicates)
        check_positive_int("seed", self.seed, minimum=0)
        check_positive_int("max_memory", self.max_memory)
        check_choice("backend", self.backend, BACKENDS)
        check_choice("dtype", self.dtype, DTYPES)
        if self.backend == "reference" and self.device not in (None, "cpu"):
            raise ValueError(f"device={self.device!r} needs backend='torch' (the reference runs on the CPU)")
        check_positive_int("khat_queries", self.khat_queries, minimum=0)

    def identity(self) -> dict[str, Any]:
        """The fields that determine the results (for the manifest; excludes device and memory budget)."""
        return {
            "estimators": [e.label for e in self.estimators],
            "params": [e.params_json for e in self.estimators],
            "num_samples": list(self.num_samples),
            "replicates": self.replicates,
            "seed": self.seed,
            "backend": self.backend,
            "dtype": self.dtype if self.backend == "torch" else "float64",
            "layers": None if self.layers is None else list(self.layers),
            "heads": None if self.heads is None else list(self.heads),
            "images": None if self.images is None else list(self.images),
            "probabilities": self.probabilities,
            "diagnostics": self.diagnostics,
            "khat_queries": self.khat_queries,
        }

    def to_json(self) -> dict[str, Any]:
        """Everything, JSON-serialisable (stored in the output metadata)."""
        data = self.identity()
        data.update(device=self.device, max_memory=self.max_memory)
        return data


@dataclass(frozen=True)
class SweepProgress:
    """Reported after every finished chunk: cells done so far out of the total."""

    done: int
    total: int
    layer: int
    label: str
    num_samples: int | None
    cells: int
    seconds: float


# ------------------------------------------------------------------------------------------------------------ seeds
def cell_seed(master_seed: int, image: str, layer: int, head: int, label_params_json: str, name: str, num_samples: int | None) -> int:
    """The seed of one cell, from the master seed and the cell's identity only.

    ``SeedSequence(master_seed, spawn_key=sha256(identity) as 8 uint32 words)`` ->
    a 63-bit int, so it fits the table's int64 ``seed`` column.

    Parameters
    ----------
    master_seed : int
    image : str
        Image name.
    layer, head : int
    label_params_json : str
        Canonical JSON of the resolved parameters.
    name : str
        Estimator name.
    num_samples : int or None
        None for estimators that take no S.
    """
    samples = None if num_samples is None else int(num_samples)
    key = json.dumps([str(image), int(layer), int(head), str(name), str(label_params_json), samples],
                     separators=(",", ":"))
    digest = hashlib.sha256(key.encode()).digest()
    words = tuple(int.from_bytes(digest[i : i + 4], "little") for i in range(0, 32, 4))
    state = np.random.SeedSequence(int(master_seed), spawn_key=words).generate_state(2, dtype=np.uint32)
    return (int(state[0]) << 31) | (int(state[1]) >> 1)


def replicate_rng(seed: int, replicate: int) -> np.random.Generator:
    """The generator of replicate ``replicate`` of the cell with this ``seed``."""
    return np.random.default_rng(np.random.SeedSequence(int(seed), spawn_key=(int(replicate),)))


def _cell_draws(spec, config: EstimatorConfig, q_shape, k_shape, seeds: Sequence[int], reps: range, num_samples) -> Draws:
    """Draws ``(len(reps), C, ...)`` for cells with these seeds, replicate by replicate."""
    per_cell = []
    for seed in seeds:
        per_rep = [
            spec.draw(q_shape, k_shape, num_samples=num_samples, replicates=1, rng=replicate_rng(seed, r), **config.params)
            for r in reps
        ]
        per_cell.append({key: np.concatenate([d.arrays[key] for d in per_rep], axis=0) for key in per_rep[0].arrays})
    keys = per_cell[0].keys()
    return Draws({key: np.stack([c[key] for c in per_cell], axis=1) for key in keys}, len(reps))


# ------------------------------------------------------------------------------------------------------ activations
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


def _selection(name: str, chosen: tuple[int, ...] | None, available: Sequence[int]) -> tuple[int, ...]:
    if chosen is None:
        return tuple(available)
    bad = [c for c in chosen if c not in available]
    if bad:
        raise ValueError(f"{name} {bad} not in the activations; available: {list(available)}")
    return tuple(dict.fromkeys(chosen))


# ------------------------------------------------------------------------------------------------------- the engine
@dataclass(frozen=True)
class _Group:
    layer: int
    est_index: int
    num_samples: int | None  # None: the estimator takes no S (rows repeated for every S)


def _plan(acts, config: SweepConfig) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], list[_Group]]:
    images_all, heads_all = acts.shape[0], acts.shape[1]
    layers = _selection("layers", config.layers, acts.layers)
    heads = _selection("heads", config.heads, range(heads_all))
    images = _selection("images", config.images, range(images_all))
    groups = []
    for layer in layers:
        for i, est in enumerate(config.estimators):
            for s in (config.num_samples if est.needs_samples else (None,)):
                groups.append(_Group(layer, i, s))
    return layers, heads, images, groups


def _row_samples(group: _Group, config: SweepConfig) -> tuple[int, ...]:
    return config.num_samples if group.num_samples is None else (group.num_samples,)


def _measure_peak(func: Callable[[], Any]) -> int:
    """Peak bytes traced by tracemalloc during ``func()`` (numpy reports its buffers)."""
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    try:
        func()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        if not was_tracing:
            tracemalloc.stop()
    return max(peak - base, 1)


class _Runner:
    """Evaluates chunks of cells of one group; holds the per-run caches (not global state)."""

    def __init__(self, acts, config: SweepConfig) -> None:
        from randattn.estimators.registry import get_spec

        self.acts = acts
        self.config = config
        self.scale = acts.scale
        self.specs = {e.name: get_spec(e.name) for e in config.estimators}
        self.unit_bytes: dict[tuple, int] = {}
        if config.backend == "torch":
            import torch

            self.torch = torch
            self.torch_dtype = {"float32": torch.float32, "float64": torch.float64}[config.dtype]
        self.itemsize = 4 if config.backend == "torch" and config.dtype == "float32" else 8

    # -- inputs
    def inputs(self, layer: int, cells: Sequence[tuple[int, int]]):
        q, k, v = self.acts.qkv(layer)
        img = np.array([c[0] for c in cells])
        hd = np.array([c[1] for c in cells])
        return q[img, hd].astype(np.float64), k[img, hd].astype(np.float64), v[img, hd].astype(np.float64)

    # -- one evaluation of the estimator (and its probabilities) on a batch of cells
    def _estimate(self, spec, est: EstimatorConfig, q, k, v, draws: Draws, with_probs: bool):
        eye = np.broadcast_to(np.eye(k.shape[-2]), (*k.shape[:-1], k.shape[-2])) if with_probs else None
        if self.config.backend == "reference":
            out = spec.reference(q, k, v, draws, scale=self.scale, **est.params)
            probs = spec.reference(q, k, eye, draws, scale=self.scale, **est.params) if with_probs else None
            return np.asarray(out, dtype=np.float64), None if probs is None else np.asarray(probs, dtype=np.float64)
        torch = self.torch
        dev, dt = self.config.device, self.torch_dtype
        tq, tk, tv = (torch.as_tensor(a, device=dev, dtype=dt) for a in (q, k, v))
        tdraws = draws.to_torch(device=dev, dtype=dt)
        with torch.no_grad():
            out = spec.batched(tq, tk, tv, tdraws, scale=self.scale, **est.params).detach().cpu().double().numpy()
            probs = None
            if with_probs:
                teye = torch.as_tensor(np.array(eye), device=dev, dtype=dt)  # a writable copy: eye may be a read-only broadcast
                probs = spec.batched(tq, tk, teye, tdraws, scale=self.scale, **est.params).detach().cpu().double().numpy()
        return out, probs

    def _replicates(self, est: EstimatorConfig) -> int:
        return self.config.replicates if est.random else 1

    # -- memory: bytes per (cell x replicate), calibrated on the float64 reference
    def unit_bytes_for(self, group: _Group, cell: tuple[int, int]) -> int:
        est = self.config.estimators[group.est_index]
        n, m = self.acts.shape[2], self.acts.shape[2]
        key = (est.label, group.num_samples, self.acts.shape[2:])
        if key not in self.unit_bytes:
            spec = self.specs[est.name]
            q, k, v = self.inputs(group.layer, [cell])

            def one() -> None:
                draws = _cell_draws(spec, est, q.shape[1:], k.shape[1:], [0], range(1), group.num_samples)
                spec.reference(q, k, v, draws, scale=self.scale, **est.params)
                if self.config.probabilities:
                    eye = np.broadcast_to(np.eye(m), (1, m, m))
                    spec.reference(q, k, eye, draws, scale=self.scale, **est.params)
                if self.config.diagnostics and est.random:
                    estimator_diagnostics(est.name, q, k, v, draws, scale=self.scale, params=est.params, khat_queries=0)

            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # calibration only: the real run reports warnings
                peak = _measure_peak(one)
            kept = 8 * n * (v.shape[-1] + (m if self.config.probabilities else 0))  # stored estimates per replicate
            scaled = peak * self.itemsize // 8 if self.config.backend == "torch" else peak
            self.unit_bytes[key] = int(1.5 * scaled) + kept
        return self.unit_bytes[key]

    def chunks(self, group: _Group, cells: Sequence[tuple[int, int]]) -> list[tuple[list[tuple[int, int]], list[range]]]:
        """Split ``cells`` into chunks of cells, each with its replicate blocks, under ``max_memory``."""
        if not cells:
            return []
        est = self.config.estimators[group.est_index]
        reps = self._replicates(est)
        unit = self.unit_bytes_for(group, cells[0])
        budget = self.config.max_memory
        per_cell = unit * reps
        if per_cell <= budget:
            size = max(1, budget // per_cell)
            return [(list(cells[i : i + size]), [range(reps)]) for i in range(0, len(cells), size)]
        block = max(1, budget // unit)
        blocks = [range(i, min(i + block, reps)) for i in range(0, reps, block)]
        return [([c], blocks) for c in cells]

    # -- a chunk -> rows
    def run_chunk(self, group: _Group, cells: list[tuple[int, int]], blocks: list[range]) -> list[dict[str, Any]]:
        start = time.perf_counter()
        est = self.config.estimators[group.est_index]
        spec = self.specs[est.name]
        q, k, v = self.inputs(group.layer, cells)
        names = self.acts.images
        seeds = [
            cell_seed(self.config.seed, names[i], group.layer, h, est.params_json, est.name, group.num_samples)
            for i, h in cells
        ]
        outs, probs, diags = [], [], []
        for reps in blocks:
            draws = _cell_draws(spec, est, q.shape[1:], k.shape[1:], seeds, reps, group.num_samples)
            out, prob = self._estimate(spec, est, q, k, v, draws, self.config.probabilities)
            outs.append(out)
            probs.append(prob)
            if self.config.diagnostics and est.random:
                diags.append((len(reps), estimator_diagnostics(
                    est.name, q, k, v, draws, scale=self.scale, params=est.params,
                    khat_queries=self.config.khat_queries if reps.start == 0 else 0,
                )))
        out = np.concatenate(outs, axis=0)
        from randattn.estimators.softmax.reference import attention_probabilities

        exact_probs = attention_probabilities(q, k, scale=self.scale)
        exact = exact_probs @ v
        metrics = replicate_metrics(out, exact, random=est.random)
        used = out[: metrics.replicates]
        rel = relative_error(used, exact)
        if self.config.probabilities:
            prob_mse = probability_mse(np.concatenate(probs, axis=0)[: metrics.replicates], exact_probs)
        else:
            prob_mse = np.full(len(cells), np.nan)
        diag = _combine_diagnostics(diags, len(cells))
        with np.errstate(divide="ignore", invalid="ignore"):
            delta_ratio = diag.delta_variance / metrics.variance
        seconds = (time.perf_counter() - start) / len(cells)
        rows = []
        for j, (i, h) in enumerate(cells):
            for s in _row_samples(group, self.config):
                rows.append({
                    "model": str(self.acts.metadata.get("model", "unknown")),
                    "image": names[i], "layer": int(group.layer), "head": int(h), "tokens": int(q.shape[-2]),
                    "estimator": est.name, "params": est.params_json, "label": est.label,
                    "num_samples": int(s), "replicates": int(metrics.replicates), "random": bool(est.random),
                    "mse": metrics.mse[j], "mse_se": metrics.mse_se[j], "variance": metrics.variance[j],
                    "bias_sq": metrics.bias_sq[j], "bias_sq_naive": metrics.bias_sq_naive[j],
                    "bias_sq_se": metrics.bias_sq_se[j], "rel_error": rel[j], "prob_mse": prob_mse[j],
                    "ess_mean": diag.ess_mean[j], "delta_var_ratio": delta_ratio[j],
                    "pareto_khat": diag.pareto_khat[j], "seconds": seconds, "seed": int(seeds[j]),
                })
        return rows


def _combine_diagnostics(diags: list, cells: int):
    """Replicate-weighted mean of ESS and delta variance over replicate blocks; k-hat from the first block."""
    if not diags:
        return nan_diagnostics((cells,))
    total = sum(n for n, _ in diags)
    first = diags[0][1]
    if len(diags) == 1:
        return first
    from dataclasses import replace

    return replace(
        first,
        ess_mean=sum(n * d.ess_mean for n, d in diags) / total,
        delta_variance=sum(n * d.delta_variance for n, d in diags) / total,
        ess_min=np.min([d.ess_min for _, d in diags], axis=0),
    )


# ------------------------------------------------------------------------------------------------------ persistence
MANIFEST = "manifest.json"


def _fingerprint(acts) -> dict[str, Any]:
    return {"shape": list(acts.shape), "layers": list(acts.layers), "images": list(acts.images),
            "model": acts.metadata.get("model"), "scale": acts.scale}


def _prepare_parts_dir(parts_dir: Path, acts, config: SweepConfig, resume: bool) -> None:
    manifest = {"config": config.identity(), "activations": _fingerprint(acts)}
    path = parts_dir / MANIFEST
    if path.exists():
        if not resume:
            raise FileExistsError(
                f"{str(parts_dir)!r} already holds a sweep; pass resume=True to continue it or remove the folder"
            )
        old = json.loads(path.read_text())
        new = json.loads(json.dumps(manifest))  # the same JSON normal form as the stored one
        changed = sorted(
            key
            for part in ("config", "activations")
            for key in set(old.get(part, {})) | set(new[part])
            if old.get(part, {}).get(key) != new[part].get(key)
        )
        if changed:
            raise ValueError(
                f"cannot resume {str(parts_dir)!r}: it was started with different settings ({', '.join(changed)}); "
                "use the same options or a new output"
            )
        return
    parts_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(manifest, indent=2, sort_keys=True))


def _write_part(parts_dir: Path, rows: list[dict[str, Any]]) -> Path:
    import pandas as pd

    first = rows[0]
    ident = json.dumps([(r["layer"], r["label"], r["num_samples"], r["image"], r["head"]) for r in rows])
    name = f"part-L{first['layer']}-{hashlib.sha1(ident.encode()).hexdigest()[:16]}.csv"
    frame = _coerce(pd.DataFrame(rows, columns=list(COLUMNS)))
    path = parts_dir / name
    atomic_write_text(path, frame.to_csv(index=False))
    return path


def _coerce(frame):
    """Column dtypes of the sweep table (the same whether built in memory or read from parts)."""
    frame = frame.loc[:, list(COLUMNS)].copy()
    for c in _STR_COLUMNS:
        frame[c] = frame[c].astype(str)
    for c in _INT_COLUMNS:
        frame[c] = frame[c].astype("int64")
    for c in _BOOL_COLUMNS:
        frame[c] = frame[c].astype(bool)
    for c in _FLOAT_COLUMNS:
        frame[c] = frame[c].astype("float64")
    return frame


def read_parts(parts_dir: str | os.PathLike):
    """All rows written so far under ``parts_dir`` (unsorted), as a DataFrame with :data:`COLUMNS`."""
    import pandas as pd

    paths = sorted(Path(parts_dir).glob("part-*.csv"))
    if not paths:
        return _coerce(pd.DataFrame({c: [] for c in COLUMNS}))
    # pandas < 3 needs float_precision="round_trip" to read back exactly what it wrote; 3.x does by default
    exact = {"float_precision": "round_trip"} if int(pd.__version__.split(".")[0]) < 3 else {}
    frames = [
        pd.read_csv(p, dtype={c: str for c in _STR_COLUMNS}, keep_default_na=False,
                    na_values={c: ["", "nan", "NaN"] for c in _FLOAT_COLUMNS}, **exact)
        for p in paths
    ]
    return _coerce(pd.concat(frames, ignore_index=True))


def consolidate(table, config: SweepConfig, acts=None):
    """The canonical table: duplicates dropped, sorted by layer, estimator, S, image, head."""
    keys = ["layer", "label", "num_samples", "image", "head"]
    table = _coerce(table).drop_duplicates(subset=keys, keep="first")
    est_order = {e.label: i for i, e in enumerate(config.estimators)}
    image_order = {name: i for i, name in enumerate(acts.images)} if acts is not None else {}
    order = table.assign(
        _est=table["label"].map(est_order),
        _img=table["image"].map(image_order) if image_order else 0,
    ).sort_values(["layer", "_est", "num_samples", "_img", "head"], kind="stable")
    return order.drop(columns=["_est", "_img"]).reset_index(drop=True)


# ----------------------------------------------------------------------------------------------------------- run it
def run_sweep(
    activations: Any,
    config: SweepConfig,
    *,
    parts_dir: str | os.PathLike | None = None,
    resume: bool = False,
    progress: Callable[[SweepProgress], None] | None = None,
):
    r"""Run every cell of ``config`` over ``activations``; return the tidy table.

    Parameters
    ----------
    activations : Activations, path or mapping
        See :func:`as_activations`. Arrays ``(images, heads, tokens, head_dim)`` per layer.
    config : SweepConfig
    parts_dir : path, optional
        Folder for incremental results (one CSV part per finished chunk plus ``manifest.json``).
        Without it results stay in memory.
    resume : bool
        Continue a sweep in ``parts_dir``: cells already written are skipped. The manifest must
        match ``config`` (device and ``max_memory`` may differ).
    progress : callable, optional
        Called with a :class:`SweepProgress` after every chunk (the CLI's progress bar; an
        exception raised here stops the sweep, keeping what is written).

    Returns
    -------
    pandas.DataFrame
        Columns :data:`COLUMNS`, one row per (image, layer, head, estimator config, S), sorted.

    Notes
    -----
    Metrics: :func:`randattn.analysis.metrics.replicate_metrics` against exact float64 softmax
    attention; ``rel_error`` from :func:`~randattn.analysis.metrics.relative_error`;
    ``prob_mse`` from the estimator evaluated with ``v = I_M`` (all catalogue estimators are
    linear in v given the draws); ``ess_mean``, ``delta_var_ratio`` (delta-method variance /
    replicate variance) and ``pareto_khat`` from :mod:`randattn.analysis.diagnostics` (NaN
    where not available). Deterministic estimators run one replicate.

    Memory: a chunk's size is ``max_memory`` divided by the peak bytes of one cell and one
    replicate, measured once per (estimator, S, shape) with tracemalloc on the float64
    reference (x 1.5, x itemsize/8 for float32 torch) plus the stored outputs; a cell whose R
    replicates alone exceed the budget is run in replicate blocks. The budget is approximate:
    the torch kernels' temporaries may differ from the reference's.
    """
    import pandas as pd

    acts = as_activations(activations)
    if not isinstance(config, SweepConfig):
        raise TypeError(f"config must be a SweepConfig, got {type(config).__name__}")
    _, heads, images, groups = _plan(acts, config)
    parts = Path(parts_dir) if parts_dir is not None else None
    done_rows = []
    done_keys: set[tuple] = set()
    if parts is not None:
        _prepare_parts_dir(parts, acts, config, resume)
        existing = read_parts(parts)
        done_rows.append(existing)
        done_keys = set(zip(existing["layer"], existing["label"], existing["num_samples"], existing["image"], existing["head"]))
    runner = _Runner(acts, config)
    all_cells = [(i, h) for i in images for h in heads]
    total = len(groups) * len(all_cells)
    todo_groups = []
    for g in groups:
        label = config.estimators[g.est_index].label
        pending = [c for c in all_cells if any(
            (g.layer, label, s, acts.images[c[0]], c[1]) not in done_keys for s in _row_samples(g, config))]
        todo_groups.append((g, pending))
    done = total - sum(len(p) for _, p in todo_groups)
    new_rows: list[dict[str, Any]] = []
    for group, pending in todo_groups:
        for cells, blocks in runner.chunks(group, pending):
            t0 = time.perf_counter()
            rows = runner.run_chunk(group, cells, blocks)
            if parts is not None:
                _write_part(parts, rows)
            new_rows.extend(rows)
            done += len(cells)
            if progress is not None:
                progress(SweepProgress(done, total, group.layer, config.estimators[group.est_index].label,
                                       group.num_samples, len(cells), time.perf_counter() - t0))
    frames = [f for f in done_rows if len(f)]
    if new_rows:
        frames.append(pd.DataFrame(new_rows, columns=list(COLUMNS)))
    table = pd.concat([_coerce(f) for f in frames], ignore_index=True) if frames else _coerce(
        pd.DataFrame({c: [] for c in COLUMNS}))
    if parts is not None:
        table = read_parts(parts)  # exactly what is on disk, so a resumed run matches bit for bit
    return consolidate(table, config, acts)


# ------------------------------------------------------------------------------------------------------ aggregation
def _bootstrap_mean_ci(values: np.ndarray, rng: np.random.Generator, n_boot: int, level: float) -> tuple[float, float]:
    values = values[np.isfinite(values)]
    if values.size < 2:
        return math.nan, math.nan
    idx = rng.integers(0, values.size, size=(n_boot, values.size))
    means = values[idx].mean(1)
    alpha = 0.5 * (1.0 - level)
    lo, hi = np.quantile(means, [alpha, 1.0 - alpha])
    return float(lo), float(hi)


def aggregate(table, *, level: float = 0.95, n_boot: int = 2000, seed: int = 0):
    r"""Summarize a sweep table like LARA app. H.1, with bootstrap confidence intervals.

    Per (layer, head, image) row -> mean over heads, then over layers, per image -> mean over
    images. The CI is a percentile bootstrap over images (resampling the per-image means), or
    over heads (the per-head means over layers) when the table holds a single image.

    Parameters
    ----------
    table : pandas.DataFrame
        A sweep table (:data:`COLUMNS`).
    level : float
        CI level.
    n_boot : int
        Bootstrap resamples.
    seed : int
        Seed of the bootstrap (each group gets ``SeedSequence(seed, spawn_key=(group index,))``).

    Returns
    -------
    pandas.DataFrame
        One row per (estimator, label, num_samples, tokens) with ``mse, mse_lo, mse_hi,
        bias_sq, bias_sq_lo, bias_sq_hi, variance, variance_lo, variance_hi, units, ci_over``
        (``units``: the number of images, or heads, bootstrapped; CIs are NaN with one unit).
    """
    import pandas as pd

    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    check_positive_int("n_boot", n_boot)
    metrics = ["mse", "bias_sq", "variance"]
    keys = ["estimator", "label", "num_samples", "tokens"]
    missing = [c for c in keys + metrics + ["image", "layer", "head"] if c not in table.columns]
    if missing:
        raise ValueError(f"table lacks column(s) {missing}; expected a sweep table")
    records = []
    for gi, (key, frame) in enumerate(table.groupby(keys, sort=False)):
        rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(gi,)))
        per_layer = frame.groupby(["image", "layer"], sort=False)[metrics].mean()  # mean over heads
        per_image = per_layer.groupby(level="image", sort=False).mean()  # mean over layers
        if len(per_image) > 1:
            units, over = per_image, "images"
        else:
            units = frame.groupby("head", sort=False)[metrics].mean()  # per head, mean over layers
            over = "heads"
        record = dict(zip(keys, key))
        for metric in metrics:
            record[metric] = float(per_image[metric].mean())
            lo, hi = _bootstrap_mean_ci(units[metric].to_numpy(dtype=np.float64), rng, n_boot, level)
            record[f"{metric}_lo"], record[f"{metric}_hi"] = lo, hi
        record["units"] = int(len(units))
        record["ci_over"] = over
        records.append(record)
    columns = keys + ["mse", "mse_lo", "mse_hi", "bias_sq", "bias_sq_lo", "bias_sq_hi",
                      "variance", "variance_lo", "variance_hi", "units", "ci_over"]
    return pd.DataFrame.from_records(records, columns=columns)


# ------------------------------------------------------------------------------------------------------------ output
OUTPUT_FORMATS = (".parquet", ".csv", ".json")


def count_cells(activations: Any, config: SweepConfig) -> int:
    """Number of (image, layer, head, estimator config, S-group) cells ``config`` runs; validates the selection.

    Raises
    ------
    ValueError
        A selected layer, head or image that the activations do not hold.
    """
    acts = as_activations(activations)
    _, heads, images, groups = _plan(acts, config)
    return len(groups) * len(heads) * len(images)


def table_records(table) -> list[dict[str, Any]]:
    """Rows as JSON-ready dicts: numpy scalars become Python ones, NaN and inf become None (exact floats)."""
    records = []
    for record in table.to_dict(orient="records"):
        clean = {}
        for key, value in record.items():
            if isinstance(value, np.generic):
                value = value.item()
            if isinstance(value, float) and not math.isfinite(value):
                value = None
            clean[key] = value
        records.append(clean)
    return records


def write_table(table, path: str | os.PathLike, metadata: Mapping[str, Any]) -> tuple[Path, Path]:
    """Write ``table`` to ``path`` (``.parquet``, ``.csv`` or ``.json`` records) and ``metadata`` beside it.

    The metadata (master seed, command line, randattn version, config, ...) goes to the sidecar
    ``<path>.meta.json`` for every format, and for parquet also into the file's schema metadata
    under the key ``randattn``. Both writes are atomic.

    Returns
    -------
    (table path, sidecar path)
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in OUTPUT_FORMATS:
        raise ValueError(f"output {str(path)!r}: unknown suffix {path.suffix!r}; use one of {list(OUTPUT_FORMATS)}")
    text = json.dumps(dict(metadata), indent=2, sort_keys=True, default=str)
    with atomic_path(path) as tmp:
        if suffix == ".parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            arrow = pa.Table.from_pandas(table, preserve_index=False)
            arrow = arrow.replace_schema_metadata({**(arrow.schema.metadata or {}), b"randattn": text.encode()})
            pq.write_table(arrow, tmp)
        elif suffix == ".csv":
            table.to_csv(tmp, index=False)
        else:
            with open(tmp, "w") as fh:
                json.dump(table_records(table), fh, indent=1)
    sidecar = path.with_name(path.name + ".meta.json")
    atomic_write_text(sidecar, text)
    return path, sidecar
