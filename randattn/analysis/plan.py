r"""Planning a sweep: estimator configurations, the sweep configuration, cell seeds and units.

Pure functions, no I/O (ARCHITECTURE sec. 11, "plan").

A **cell** is one (image, layer, head) input with one estimator configuration and one sample
count S; it yields one row of the tidy table. A **unit** is the cells of one (layer,
estimator configuration, S, image) over every selected head: the grain of execution,
persistence and resume. A unit's rows depend only on its identity, the master seed and the
inputs, never on the memory budget, the executor or the order units run in:

- each cell's seed comes from the master seed and the cell's identity (:func:`cell_seed`),
  and replicate r of a cell draws from ``SeedSequence(cell_seed, spawn_key=(r,))``
  (:func:`replicate_rng`);
- the memory budget only splits a unit's replicates into blocks, and every reduction is
  taken per (replicate, cell) before the blocks are joined (see
  :mod:`randattn.analysis.execute`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from randattn._validation import ParameterError, check_choice, check_positive_int
from randattn.estimators.masks import Mask

__all__ = [
    "BACKENDS",
    "DTYPES",
    "EstimatorConfig",
    "SweepConfig",
    "SweepProgress",
    "Unit",
    "estimator_config",
    "parse_estimator_list",
    "bind_token_layout",
    "with_threads",
    "cell_seed",
    "replicate_rng",
    "StackedDrawError",
    "StackedGenerators",
    "plan_units",
    "select",
    "total_cells",
]

BACKENDS = ("torch", "reference")
#: ``auto``: float64 for configurations whose weights can be negative (their float32 rounding is not
#: small against the error being measured), float32 otherwise; see :func:`EstimatorConfig.torch_dtype`
DTYPES = ("auto", "float32", "float64")


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

    @property
    def signed_weights(self) -> bool:
        """Whether the estimator's weights can be negative, so that its sums cancel.

        The spec declares it (:meth:`~randattn.estimators.base.EstimatorSpec.has_signed_weights`):
        e.g. LARA's decoupled and coupled weights (eq. 38, 37) without ``alpha_clamp`` and the
        trigonometric feature map are signed. In float32 their cancelling sums lose digits that
        are not small against the MSE being measured (up to 2e-2 absolute on DINOv2 layer 3), so
        ``dtype="auto"`` runs them in float64.
        """
        from randattn.estimators.registry import get_spec

        return get_spec(self.name).has_signed_weights(self.params)

    def torch_dtype_name(self, dtype: str) -> str:
        """The torch dtype used for this configuration under the sweep's ``dtype`` setting."""
        if dtype != "auto":
            return dtype
        return "float64" if self.signed_weights else "float32"


def estimator_config(name: str, params: Mapping[str, Any] | None = None) -> EstimatorConfig:
    """Resolve ``name`` (optionally ``"name:p=v,..."``) and ``params`` into an :class:`EstimatorConfig`.

    Raises
    ------
    ValueError
        Unknown estimator or parameter, or a disallowed value (message from the registry).
    """
    from randattn.estimators.registry import get_spec, parse_estimator

    try:
        parsed_name, parsed = parse_estimator(name)
        given = {**parsed, **dict(params or {})}
        spec = get_spec(parsed_name)
        resolved = spec.resolve_params(given)
    except (TypeError, ValueError) as exc:
        if type(exc) not in (TypeError, ValueError) or str(name).split(":")[0].strip() in str(exc):
            raise  # a typed error keeps its fields; a message naming the estimator says where already
        raise type(exc)(f"estimator {name!r}: {exc}") from None
    preset = given.get("preset")
    if preset is not None and preset != "paper":
        # a preset names its parameters in one word: keep the word, plus what was set beside it
        implied = spec.resolve_params({"preset": preset})
        extra = [f"{p}={_fmt(resolved[p])}" for p in spec.params if resolved[p] != implied[p]]
        label = f"{parsed_name}:preset={preset}" + ("," + ",".join(extra) if extra else "")
    else:
        non_default = [f"{p}={_fmt(resolved[p])}" for p, param in spec.params.items() if resolved[p] != param.default]
        label = parsed_name + (":" + ",".join(non_default) if non_default else "")
    return EstimatorConfig(
        name=parsed_name,
        params=resolved,
        label=label,
        params_json=json.dumps(resolved, sort_keys=True, separators=(",", ":"), default=str),
        random=bool(spec.is_random(resolved)),
        needs_samples=spec.needs_samples_of(resolved),
    )


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def with_threads(config: SweepConfig) -> SweepConfig:
    """``config`` with ``threads`` resolved to this process's torch thread count (torch backend)."""
    if config.backend != "torch" or config.threads is not None:
        return config
    import dataclasses

    import torch

    return dataclasses.replace(config, threads=int(torch.get_num_threads()))


def bind_token_layout(config: EstimatorConfig, grid: Sequence[int] | None, prefix_tokens: int) -> EstimatorConfig:
    """``config`` with the input's patch grid filled in, for estimators with ``layout="grid"``.

    Estimators with windows or segments (lara, eva, scatterbrain, local) take ``layout``,
    ``grid`` and ``prefix_tokens``. When ``layout`` is ``"grid"`` and no ``grid`` was given,
    the activation file's grid ``(h, w)`` is used, and its ``prefix_tokens`` when the
    configuration left the default 0. The label stays what the user wrote (so tables of several
    token counts group together); ``params`` / ``params_json`` record what actually ran.
    """
    params = dict(config.params)
    if grid is None or params.get("layout") != "grid" or "grid" not in params or params.get("grid") is not None:
        return config
    params["grid"] = f"{int(grid[0])}x{int(grid[1])}"
    if "prefix_tokens" in params and not params["prefix_tokens"]:
        params["prefix_tokens"] = int(prefix_tokens)
    from randattn.estimators.registry import get_spec

    resolved = get_spec(config.name).resolve_params(params)
    return EstimatorConfig(
        name=config.name, params=resolved, label=config.label,
        params_json=json.dumps(resolved, sort_keys=True, separators=(",", ":"), default=str),
        random=config.random, needs_samples=config.needs_samples,
    )


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
    backend : {"torch", "reference"}
        torch: the batched estimators (the default); reference: the float64 numpy definitions.
    device : str or None
        torch device (``"cuda"``, ``"cpu"``); torch backend only.
    dtype : {"auto", "float32", "float64"}
        torch dtype; ``auto`` is float64 for signed-weight configurations
        (:attr:`EstimatorConfig.signed_weights`) and float32 otherwise. The reference is
        always float64. Under ``auto`` a float64 run forms the implied probabilities by a
        float32 product where the estimator offers one and its rounding bound moves each
        (replicate, cell)'s probability squared error by at most
        :data:`~randattn.analysis.estimate_block.PROBABILITY_ROUNDING_RTOL` (1e-3) of itself.
    max_memory : int
        Approximate peak bytes of the estimator work of one unit (see
        :mod:`randattn.analysis.execute`).
    layers, heads, images : tuple of int or None
        Layer ids, head indices and image indices to run; None for all.
    probabilities : bool
        Also measure the MSE of the implied attention probabilities (an extra estimator
        call with ``v = I_M``).
    diagnostics : bool
        Importance-sampling diagnostics where available (:mod:`randattn.analysis.diagnostics`).
    khat_queries : int
        Queries per cell on which Pareto k-hat is fitted.
    threads : int or None
        torch intra-op threads each process computes with. A float32 product's rounding depends
        on how many threads split it, so the thread count is part of what makes a table
        reproducible bit for bit: it is fixed here, recorded, and applied in every process that
        runs units (Dask workers included). None: this process's ``torch.get_num_threads()``,
        resolved when the sweep starts.
    check_reference : float in [0, 1]
        torch backend: the fraction of units whose first cell and replicate are re-run on the
        float64 reference with the same draws (at least the first unit of every estimator
        configuration when > 0); the largest deviation goes to the ``ref_max_abs_dev`` column.
    mask : None, str or mapping of layer -> kind
        The attention mask of every layer (:mod:`randattn.analysis.masking`): None (bidirectional),
        ``"causal"`` or ``"sliding:W"`` for all layers, or one kind per layer (e.g. read from an
        activation file, :func:`~randattn.analysis.masking.masks_of_activations`). Stored canonically
        (:func:`~randattn.analysis.masking.normalize_layer_masks`): one kind, or ``((layer, kind), ...)``.
        The estimators, the exact reference and the probabilities all apply it. Cell seeds and unit
        ids do not depend on it (the mask is a property of the run, recorded in :meth:`identity`),
        so a causal and a bidirectional run of the same cells use the same random streams.
    position_buckets : str or tuple of int
        Per-position metrics (:mod:`randattn.analysis.positions`): ``"auto"`` (``log2`` buckets on
        masked layers, none on bidirectional ones), ``"none"``, ``"log2"`` (every layer), or lower
        bucket edges such as ``(1, 2, 4, 8, 64)`` (every layer).
    queries : str
        Which query rows are measured (:mod:`randattn.analysis.queries`): ``"all"`` (the default), ``"last:K"``
        (the decode regime under the causal mask) or ``"sample:K"`` (K rows drawn without replacement from a seed
        derived from ``seed``). The estimate, the exact truth and every metric hold the K rows only. Recorded in
        :meth:`identity` only when not ``"all"``, so that earlier runs stay resumable.
    epsilon : float in (0, 1) or None
        The relative output error whose violation rate the table reports
        (:mod:`randattn.analysis.relative_error`): ``violation_rate`` = P(||y_hat_n - y_n|| / ||y_n|| > epsilon)
        over the queries and replicates of a cell, with its Clopper-Pearson interval. An estimator configuration
        that promises (epsilon, delta) (:meth:`~randattn.estimators.base.EstimatorSpec.promise_of`) is measured
        against its own epsilon instead. None: only promising configurations get the columns.
    """

    estimators: tuple[EstimatorConfig, ...]
    num_samples: tuple[int, ...]
    replicates: int = 16
    seed: int = 0
    backend: str = "torch"
    device: str | None = None
    dtype: str = "auto"
    max_memory: int = 2**30
    layers: tuple[int, ...] | None = None
    heads: tuple[int, ...] | None = None
    images: tuple[int, ...] | None = None
    probabilities: bool = True
    diagnostics: bool = True
    khat_queries: int = 16
    check_reference: float = 0.02
    threads: int | None = None
    mask: Any = None
    position_buckets: Any = "auto"
    queries: str = "all"
    epsilon: float | None = None

    def __post_init__(self) -> None:
        from randattn.analysis.masking import normalize_layer_masks
        from randattn.analysis.positions import parse_position_buckets
        from randattn.analysis.queries import parse_query_selection
        from randattn.analysis.relative_error import check_epsilon

        # canonical and hashable (a Dask worker caches its runner by the configuration)
        object.__setattr__(self, "mask", normalize_layer_masks(self.mask))
        object.__setattr__(self, "position_buckets", parse_position_buckets(self.position_buckets))
        object.__setattr__(self, "queries", parse_query_selection(self.queries))
        if self.epsilon is not None:
            object.__setattr__(self, "epsilon", check_epsilon(self.epsilon))
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
            raise ParameterError("device", repr(self.device), " needs backend='torch' (the reference runs on the CPU)")
        check_positive_int("khat_queries", self.khat_queries, minimum=0)
        if self.threads is not None:
            check_positive_int("threads", self.threads)
        fraction = self.check_reference
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= float(fraction) <= 1.0:
            raise ParameterError("check_reference", None, f" must be a fraction in [0, 1], got {fraction!r}")

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
            "check_reference": float(self.check_reference) if self.backend == "torch" else 0.0,
            "threads": self.threads if self.backend == "torch" else None,
            # recorded only where set, so that the identity (and the manifest) of a bidirectional run is what it was
            # before masks existed: its finished tables and parts stay resumable
            **({"mask": self.mask_json()} if self.mask is not None else {}),
            **({"position_buckets": self.position_buckets_json()} if self.position_buckets != "auto" else {}),
            **({"queries": self.queries} if self.queries != "all" else {}),
            **({"epsilon": self.epsilon} if self.epsilon is not None else {}),
        }

    def mask_of(self, layer: int) -> str | None:
        """The mask kind of ``layer``: None (bidirectional), ``"causal"`` or ``"sliding:W"``.

        Raises
        ------
        ValueError
            The run gives masks per layer and none for ``layer``.
        """
        if not isinstance(self.mask, tuple):
            return self.mask
        kinds = dict(self.mask)
        if int(layer) not in kinds:
            raise ValueError(f"the run's mask names layers {sorted(kinds)} but not layer {layer}; give every "
                             "selected layer a mask")
        return kinds[int(layer)]

    def layer_mask(self, layer: int) -> Mask:
        """The :class:`~randattn.estimators.masks.Mask` of ``layer``, the one value the sweep passes around (its
        label, estimator keywords and visible keys); its kind is :meth:`mask_of`.

        Raises
        ------
        ValueError
            The run gives masks per layer and none for ``layer``.
        """
        return Mask.parse(self.mask_of(layer))

    def mask_json(self) -> Any:
        """The mask as JSON: one kind (str or None) or ``{"<layer>": kind}``."""
        return {str(layer): kind for layer, kind in self.mask} if isinstance(self.mask, tuple) else self.mask

    def position_buckets_json(self) -> Any:
        """The bucketing as JSON: ``"auto"``, ``"none"``, ``"log2"`` or the list of lower edges."""
        return list(self.position_buckets) if isinstance(self.position_buckets, tuple) else self.position_buckets

    def positions_of(self, layer: int) -> str | tuple[int, ...] | None:
        """The bucketing of ``layer``'s per-position metrics, or None when the layer gets none."""
        scheme = self.position_buckets
        if scheme == "none" or (scheme == "auto" and self.mask_of(layer) is None):
            return None
        return "log2" if scheme == "auto" else scheme

    def query_rows(self, num_queries: int) -> np.ndarray | None:
        """The measured query rows of N = ``num_queries`` (:func:`~randattn.analysis.queries.query_rows`), None
        for all; ValueError when K > N."""
        from randattn.analysis.queries import query_rows

        return query_rows(self.queries, num_queries, self.seed)

    def to_json(self) -> dict[str, Any]:
        """Everything, JSON-serialisable (stored in the output metadata)."""
        data = self.identity()
        data.update(device=self.device, max_memory=self.max_memory, mask=self.mask_json(),
                    position_buckets=self.position_buckets_json(), queries=self.queries, epsilon=self.epsilon)
        return data


@dataclass(frozen=True)
class SweepProgress:
    """Reported after every finished unit: cells done so far out of the total."""

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


#: the word that sets a query block's streams apart (:func:`replicate_rng`): a spawn key of three words, which no
#: replicate's one word and no query sample's two (:func:`randattn.analysis.queries.query_sample_seed`) can equal
_QUERY_BLOCK_WORD = 0x0B10C


def replicate_rng(seed: int, replicate: int, query_block: int | None = None) -> np.random.Generator:
    """The generator of replicate ``replicate`` of the cell with this ``seed``; with ``query_block``, of that block
    of the cell's queries (:mod:`randattn.analysis.query_blocks`), a stream of its own.

    ``Generator(PCG64(...))`` is what ``default_rng`` builds from a SeedSequence (the same bits), without its
    argument dispatch: a third of the cost, paid R x cells times per unit.
    """
    key = (int(replicate),) if query_block is None else (int(replicate), _QUERY_BLOCK_WORD, int(query_block))
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(int(seed), spawn_key=key)))


class StackedDrawError(ValueError):
    """A draw that declares ``stacked_draw`` asked a :class:`StackedGenerators` grid for what it does not stack."""


class StackedGenerators:
    """A grid of numpy Generators that draws each array as the stack of one draw per generator.

    An estimator's ``draw`` asks its ``rng`` for arrays whose leading dims are (replicates,
    *batch). Given a grid of generators of shape G, a request of shape ``(*G, *rest)`` is
    answered element by element of G, each generator drawing ``(1, ..., 1, *rest)`` -- the
    request its ``draw`` would make with one replicate and no batch dims -- so one ``draw``
    over the grid returns, bit for bit, the draws of the per-generator calls stacked, while the
    draw's own arithmetic (e.g. the QR of orthogonal features) runs once on the stack.

    Parameters
    ----------
    generators : array_like of numpy.random.Generator
        Any shape G (nested lists are taken as an object array).
    """

    def __init__(self, generators: Any) -> None:
        grid = np.empty(np.shape(generators), dtype=object)
        grid[...] = generators  # an object array without numpy reading the Generators as sequences
        if grid.size == 0 or not all(isinstance(g, np.random.Generator) for g in grid.flat):
            raise TypeError("StackedGenerators needs a non-empty grid of numpy.random.Generator objects")
        self._grid = grid

    @property
    def shape(self) -> tuple[int, ...]:
        """The grid's shape G: the leading dims of every array it draws."""
        return self._grid.shape

    def _size(self, size: Any) -> tuple[int, ...]:
        size = (int(size),) if np.ndim(size) == 0 and size is not None else tuple(size or ())
        lead = self._grid.shape
        if size[: len(lead)] != lead:
            raise ValueError(f"a draw of shape {size} does not start with the generators' grid shape {lead}")
        return size

    def _draw(self, method: str, size: Any, *args: Any, **kwargs: Any) -> np.ndarray:
        size = self._size(size)
        one = (1,) * self._grid.ndim + size[self._grid.ndim:]
        parts = [getattr(g, method)(*args, size=one, **kwargs) for g in self._grid.flat]
        return np.concatenate(parts, axis=0).reshape(size)

    def _fill(self, method: str, size: Any, dtype: Any) -> np.ndarray:
        """Each generator fills its own slice of one array (``out=``): the numbers of ``_draw``, without the
        concatenation's copy of the whole stack (RA's noise is R x C x N x S x D values)."""
        size = self._size(size)
        out = np.empty(size, dtype=dtype)
        rows = out.reshape(self._grid.size, -1)  # a view: out is contiguous
        for g, row in zip(self._grid.flat, rows):
            getattr(g, method)(dtype=dtype, out=row)
        return out

    def standard_normal(self, size: Any, dtype: Any = np.float64) -> np.ndarray:
        """``Generator.standard_normal`` per generator, stacked."""
        return self._fill("standard_normal", size, dtype)

    def random(self, size: Any, dtype: Any = np.float64) -> np.ndarray:
        """``Generator.random`` per generator, stacked."""
        return self._fill("random", size, dtype)

    def chisquare(self, df: float, size: Any) -> np.ndarray:
        """``Generator.chisquare`` per generator, stacked."""
        return self._draw("chisquare", size, df)

    def __getattr__(self, name: str) -> Any:
        """Any other method of numpy's ``Generator`` (``integers``, ``choice``, ...) is not stacked: a draw that asks
        for one is refused by name here (ValueError), not as a missing attribute deep in its own code."""
        if name.startswith("_") or not hasattr(np.random.Generator, name):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        raise StackedDrawError(
            f"draw() asked its rng for Generator.{name}, which a grid of generators does not stack (it stacks "
            "standard_normal, random and chisquare): an estimator whose draw needs more must not declare "
            "stacked_draw (randattn check: 'stacked draw')")


# ------------------------------------------------------------------------------------------------------------ units
@dataclass(frozen=True)
class Unit:
    """The cells of one (layer, estimator configuration, S, image) over the selected heads.

    Attributes
    ----------
    layer : int
    est_index : int
        Index into ``SweepConfig.estimators``.
    num_samples : int or None
        None for estimators that take no S (their rows are repeated for every S).
    image : int
        Image index in the activations.
    image_name : str
    heads : tuple of int
    label : str
        The estimator configuration's label.
    seeds : tuple of int
        :func:`cell_seed` of each head's cell, in ``heads`` order.
    check_reference : bool
        Whether this unit's first cell and replicate are re-run on the reference.
    """

    layer: int
    est_index: int
    num_samples: int | None
    image: int
    image_name: str
    heads: tuple[int, ...]
    label: str
    seeds: tuple[int, ...]
    check_reference: bool = False

    @property
    def uid(self) -> str:
        """Stable id: the layer, then a digest of the configuration, S, image and heads."""
        key = json.dumps([self.layer, self.label, self.num_samples, self.image_name, list(self.heads)],
                         separators=(",", ":"))
        return f"L{self.layer}-{hashlib.sha1(key.encode()).hexdigest()[:16]}"

    def row_samples(self, config: SweepConfig) -> tuple[int, ...]:
        """The S values this unit's rows are reported at."""
        return config.num_samples if self.num_samples is None else (self.num_samples,)


def select(name: str, chosen: tuple[int, ...] | None, available: Sequence[int]) -> tuple[int, ...]:
    """``chosen`` (deduplicated) after checking each is ``available``; all of them when None."""
    if chosen is None:
        return tuple(available)
    bad = [c for c in chosen if c not in available]
    if bad:
        raise ValueError(f"{name} {bad} not in the activations; available: {list(available)}")
    return tuple(dict.fromkeys(chosen))


def _checked(uid: str, seed: int, fraction: float) -> bool:
    """A uniform in [0, 1) from the unit id and master seed, below ``fraction``."""
    digest = hashlib.sha256(f"{seed}:{uid}".encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2.0**64 < fraction


def plan_units(
    layers_available: Sequence[int], num_heads: int, image_names: Sequence[str], config: SweepConfig
) -> list[Unit]:
    """Every unit of ``config`` in canonical order (layer, image, estimator, S).

    The units of one (layer, image) are consecutive so that a runner computes their exact
    softmax attention once. The reference check picks the same units in any order: the first
    (layer, image, S) of each configuration, and a hash of the unit id for the rest.

    Parameters
    ----------
    layers_available : sequence of int
        Layer ids the activations hold.
    num_heads : int
    image_names : sequence of str
        Image names in array order.
    config : SweepConfig

    Raises
    ------
    ValueError
        A selected layer, head or image the activations do not hold.
    """
    layers = select("layers", config.layers, list(layers_available))
    heads = select("heads", config.heads, range(num_heads))
    images = select("images", config.images, range(len(image_names)))
    fraction = float(config.check_reference) if config.backend == "torch" else 0.0
    units, first_of_config = [], set()
    for layer in layers:
        for image in images:
            name = image_names[image]
            for i, est in enumerate(config.estimators):
                for s in (config.num_samples if est.needs_samples else (None,)):
                    seeds = tuple(
                        cell_seed(config.seed, name, layer, h, est.params_json, est.name, s) for h in heads
                    )
                    unit = Unit(layer, i, s, image, name, heads, est.label, seeds)
                    check = fraction > 0 and (est.label not in first_of_config
                                              or _checked(unit.uid, config.seed, fraction))
                    first_of_config.add(est.label)
                    units.append(Unit(layer, i, s, image, name, heads, est.label, seeds, check))
    return units


def total_cells(units: Sequence[Unit]) -> int:
    """Number of cells (one per head) in ``units``."""
    return sum(len(u.heads) for u in units)
