"""The one-command demo: capture Q/K/V from the bundled DINOv2 on bundled images, sweep estimators, report.

``run_demo`` chains the library's pieces: :func:`randattn.activations.dinov2.capture_dinov2` (once per input
size, i.e. token count), :func:`randattn.analysis.sweep.run_sweep` (estimators x S x replicates on every
captured (image, layer, head)), :func:`randattn.analysis.sweep.write_table`, the LARA-Fig.-1-style figure
and the HTML report. The capture, the model and the sweep are parameters whose defaults are those functions: a
caller can measure activations captured elsewhere, or run the sweep on a Dask client
(``functools.partial(run_sweep, scheduler=client)``).
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import pandas as pd

from randattn._validation import ParameterError

__all__ = ["DemoConfig", "DemoResult", "DemoStep", "QUICK", "demo_outputs", "run_demo"]

#: estimators of the default demo over S (LARA Fig. 1's methods plus EVA; softmax is the exact reference row;
#: RA runs at S = 1, see DemoConfig.single_sample). LARA appears twice: its default decoupled weights (eq. 38)
#: can be negative and make the normalizer vanish on real ViT keys, which the balance heuristic (eq. 36) avoids.
DEFAULT_ESTIMATORS: tuple[str, ...] = ("softmax", "rfa:coupling=orthogonal", "lara", "lara:preset=official-code",
                                       "lara:weighting=balance", "eva")


@dataclass(frozen=True)
class DemoConfig:
    """What the demo runs.

    Attributes
    ----------
    images : tuple of str
        scikit-image sample names (``skimage.data.<name>()``).
    sizes : tuple of int
        Input sides in pixels, multiples of 14: 196, 336, 392 give 197, 577, 785 tokens.
    layers : tuple of int
        DINOv2 ViT-S/14 layers (0-11); the first and the last by default, to fit a 2-core CPU in about
        five minutes (add 5 for a middle layer: about 50% longer).
    heads : tuple of int or None
        Heads to measure (None: all six).
    samples : tuple of int
        Sample counts S.
    replicates : int
        Replicates R per (image, layer, head, estimator, S).
    estimators : tuple of str
        Estimator specs (``"rfa:coupling=orthogonal"``), run at every S in ``samples``.
    single_sample : tuple of str
        Estimator specs run at S = 1 only, drawn as a horizontal line as RA is in LARA Fig. 1 ("we only draw
        1 sample in RA estimation"). RA costs O(N M S D), which at 785 tokens and S = 128 would take the
        demo's whole budget.
    seed : int
        Master seed of the sweep.
    backend : {"torch", "reference"}
        Estimator implementation used by the sweep.
    probabilities : bool
        Also measure the MSE of the attention probabilities (one more estimator call per cell).
    diagnostics : bool
        Importance-sampling diagnostics (ESS, delta-method variance, Pareto k-hat).
    """

    images: tuple[str, ...] = ("astronaut", "coffee")
    sizes: tuple[int, ...] = (196, 336, 392)
    layers: tuple[int, ...] = (0, 11)
    heads: tuple[int, ...] | None = None
    samples: tuple[int, ...] = (16, 32, 64, 128)
    replicates: int = 8
    estimators: tuple[str, ...] = DEFAULT_ESTIMATORS
    single_sample: tuple[str, ...] = ("ra",)
    seed: int = 0
    backend: str = "torch"
    probabilities: bool = False
    diagnostics: bool = True

    def __post_init__(self) -> None:
        """Refuse what the capture and the sweep would, before either runs.

        Raises
        ------
        ParameterError
            Naming the field (a command line names its option for it).
        """
        for name in ("images", "sizes", "layers", "samples", "estimators"):
            value = getattr(self, name)
            if isinstance(value, (str, bytes)) or not isinstance(value, tuple) or not value:
                raise ParameterError(name, None, f" must be a non-empty tuple, got {value!r}")
        bad_sizes = [s for s in self.sizes if not isinstance(s, int) or s <= 0 or s % 14]
        if bad_sizes:
            raise ParameterError("sizes", None, f" must be positive multiples of 14 (196, 336, 392), got {bad_sizes}")
        bad_layers = [x for x in self.layers if not isinstance(x, int) or not 0 <= x < 12]
        if bad_layers:
            raise ParameterError("layers", None, f" must be in 0..11 (DINOv2 ViT-S/14 has 12), got {bad_layers}")
        if self.heads is not None:
            bad_heads = [h for h in self.heads if not isinstance(h, int) or not 0 <= h < 6]
            if not self.heads or bad_heads:
                raise ParameterError("heads", None, f" must be None or a non-empty tuple of 0..5, got {self.heads!r}")
        bad_samples = [s for s in self.samples if not isinstance(s, int) or s <= 0]
        if bad_samples:
            raise ParameterError("samples", None, f" must be positive integers, got {bad_samples}")
        if not isinstance(self.replicates, int) or self.replicates < 2:
            raise ParameterError("replicates", None,
                                 f" must be an integer >= 2 (variance needs two), got {self.replicates!r}")
        if not isinstance(self.single_sample, tuple) or isinstance(self.single_sample, str):
            raise ParameterError("single_sample", None,
                                 f" must be a tuple (possibly empty), got {self.single_sample!r}")
        if self.backend not in ("torch", "reference"):
            raise ParameterError("backend", None, f" must be 'torch' or 'reference', got {self.backend!r}")


#: a configuration for smoke tests: one image, one small input, one layer, two heads, two S, R = 3
QUICK = DemoConfig(images=("astronaut",), sizes=(112,), layers=(0,), heads=(0, 1), samples=(4, 8), replicates=3,
                   estimators=("softmax", "rfa:coupling=orthogonal"), single_sample=("ra",))


@dataclass(frozen=True)
class DemoStep:
    """A progress report: ``name`` of the step, ``done`` out of ``total`` units of it."""

    name: str
    done: int
    total: int


@dataclass(frozen=True)
class DemoResult:
    """What the demo produced.

    Attributes
    ----------
    table : pandas.DataFrame
        The results table (every token count).
    summary : pandas.DataFrame
        :func:`randattn.analysis.sweep.aggregate` of it.
    files : dict
        What the run wrote, in the order it wrote it: ``"table"``, ``"figure.png"`` / ``"figure.svg"`` and
        ``"report"`` -> path; the LM demo adds ``"positions"``, ``"position.<format>"`` and, in the decode view,
        ``"error-vs-budget.<format>"``.
    seconds : dict
        Wall-clock seconds of ``capture``, ``sweep``, ``report`` and ``total``.
    """

    table: pd.DataFrame
    summary: pd.DataFrame
    files: dict[str, Path] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)


def _default_capture(images: Sequence[str], size: int, layers: Sequence[int], model: Any):
    from randattn.activations.dinov2 import capture_dinov2

    return capture_dinov2("skimage:" + ",".join(images), size, tuple(layers), model=model)


def _default_model() -> Any:
    from randattn.activations.dinov2 import Dinov2Onnx

    return Dinov2Onnx()


def run_demo(
    config: DemoConfig,
    out_dir: str | os.PathLike,
    *,
    command: str | None = None,
    capture: Callable[..., Any] | None = None,
    load_model: Callable[[], Any] | None = None,
    sweep: Callable[..., pd.DataFrame] | None = None,
    progress: Callable[[DemoStep], None] | None = None,
    table_name: str = "results.csv",
    formats: Sequence[str] = ("png", "svg"),
) -> DemoResult:
    """Capture, sweep, and write the table, the MSE-vs-samples figure and the HTML report to ``out_dir``.

    Parameters
    ----------
    config : DemoConfig
    out_dir : str or path-like
        Created if needed; existing files of the same names (:func:`demo_outputs`) are replaced (``randattn demo``
        refuses that without ``--force``).
    command : str, optional
        The command line, recorded in the metadata and the report.
    capture : callable(images, size, layers, model) -> Activations, optional
        Default: :func:`randattn.activations.dinov2.capture_dinov2` on scikit-image samples.
    load_model : callable() -> model, optional
        Builds the model once for every size (default: :class:`~randattn.activations.dinov2.Dinov2Onnx`).
    sweep : callable(activations, SweepConfig, progress=...) -> DataFrame, optional
        Default: :func:`randattn.analysis.sweep.run_sweep`.
    progress : callable(DemoStep), optional
        Called as steps advance (``"loading model"``, ``"capture"``, ``"sweep N=197"``, ``"report"``).
    table_name : str
        File name of the table (``.csv``, ``.parquet`` or ``.json``).
    formats : sequence of str
        Figure formats.

    Returns
    -------
    DemoResult
    """
    from randattn.results.summary import aggregate
    from randattn.analysis.plan import SweepConfig, parse_estimator_list
    from randattn.results.table import write_table
    from randattn._files import named_write_errors
    from randattn.reports.figures import mse_vs_samples_figure, save_figure
    from randattn.reports.html import write_report

    if not isinstance(config, DemoConfig):
        raise TypeError(f"config must be a DemoConfig, got {type(config).__name__}")
    capture = _default_capture if capture is None else capture
    load_model = _default_model if load_model is None else load_model
    if sweep is None:
        from randattn.analysis.sweep_run import run_sweep as sweep
    report = progress if progress is not None else (lambda step: None)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    common = dict(replicates=config.replicates, seed=config.seed, backend=config.backend, heads=config.heads,
                  probabilities=config.probabilities, diagnostics=config.diagnostics)
    sweep_configs = [SweepConfig(estimators=parse_estimator_list(list(config.estimators)),
                                 num_samples=config.samples, **common)]
    if config.single_sample:
        sweep_configs.append(SweepConfig(estimators=parse_estimator_list(list(config.single_sample)),
                                         num_samples=(1,), **common))
    seconds: dict[str, float] = {}
    start = time.perf_counter()

    report(DemoStep("loading model", 0, 1))
    model = load_model()
    report(DemoStep("loading model", 1, 1))
    activations = []
    for index, size in enumerate(config.sizes):
        report(DemoStep("capture", index, len(config.sizes)))
        activations.append(capture(config.images, size, config.layers, model))
    report(DemoStep("capture", len(config.sizes), len(config.sizes)))
    seconds["capture"] = time.perf_counter() - start

    tables = []
    for acts in activations:
        tables += run_sweeps(sweep, acts, sweep_configs, report, f"sweep N={int(acts.shape[2])}")
    table = pd.concat(tables, ignore_index=True)
    seconds["sweep"] = time.perf_counter() - start - seconds["capture"]

    report(DemoStep("report", 0, 1))
    t_report = time.perf_counter()
    metadata = demo_metadata(config, command, sweep_configs, table, tables,
                             activations=[_activation_summary(acts) for acts in activations])
    with named_write_errors(out / table_name):
        table_path, metadata_path = write_table(table, out / table_name, metadata)
    files = {"table": table_path, "metadata": metadata_path}
    figure = mse_vs_samples_figure(table, metadata=metadata)
    for path in save_figure(figure, out / "mse-vs-samples", formats):
        files[f"figure.{path.suffix[1:]}"] = path
    seconds["report"] = time.perf_counter() - t_report
    seconds["total"] = time.perf_counter() - start
    metadata["seconds"] = {k: round(v, 1) for k, v in seconds.items()}
    files["report"] = write_report(table, out, metadata=metadata, command=command)
    seconds["report"] = time.perf_counter() - t_report
    seconds["total"] = time.perf_counter() - start
    report(DemoStep("report", 1, 1))
    return DemoResult(table=table, summary=aggregate(table, seed=config.seed), files=files, seconds=seconds)


def demo_outputs(table_name: str = "results.csv", formats: Sequence[str] = ("png", "svg")) -> tuple[str, ...]:
    """The names of the files :func:`run_demo` writes into its folder (with the same ``table_name`` and
    ``formats``)."""
    return (table_name, f"{table_name}.meta.json", *(f"mse-vs-samples.{fmt}" for fmt in formats), "report.html")


def run_sweeps(sweep: Callable[..., Any], acts: Any, sweep_configs: Sequence[Any],
               report: Callable[[DemoStep], None], step: str) -> list[Any]:
    """``sweep(acts, config, progress=...)`` for each of ``sweep_configs``, reported as one step ``step`` whose
    total is the cells of them all; their results, in order."""
    totals = [_cells(acts, c) for c in sweep_configs]
    results, offset = [], 0
    for sweep_config, total in zip(sweep_configs, totals):

        def on_progress(p: Any, offset: int = offset) -> None:
            report(DemoStep(step, offset + int(p.done), sum(totals)))

        results.append(sweep(acts, sweep_config, progress=on_progress))
        offset += total
    return results


def demo_metadata(config: Any, command: str | None, sweep_configs: Sequence[Any], table: pd.DataFrame,
                  tables: Sequence[pd.DataFrame], *, activations: Any) -> dict[str, Any]:
    """What a demo records beside its table: the command, its configuration and sweeps, the activations
    (``activations``, as the demo summarizes them), the sweeps' warnings, and -- as ``randattn mse`` records
    them -- the float64 reference check of the checked units and where the numbers were computed."""
    from randattn.analysis.records import compute_record, reference_check_summary

    return {
        "command_line": command,
        "demo": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(config).items()},
        "sweeps": [c.to_json() for c in sweep_configs],
        "seed": config.seed,
        "randattn_version": _version(),
        "activations": activations,
        "warnings": _merge_warnings(t.attrs.get("warnings", []) for t in tables),
        "reference_check": reference_check_summary(table),
        "compute": compute_record(sweep_configs[0], table) if sweep_configs else None,
    }


def _merge_warnings(lists) -> list[dict[str, Any]]:
    """The sweeps' warning records (category, message, label; units, count) summed over sweeps -- whose units are
    distinct -- most units first (:func:`~randattn.analysis.sweep.summarize_warnings`)."""
    totals: dict[tuple, list[int]] = {}
    for records in lists:
        for r in records:
            total = totals.setdefault((r["category"], r["message"], r["label"]), [0, 0])
            total[0] += int(r["units"])
            total[1] += int(r["count"])
    return [{"category": c, "message": m, "label": label, "units": units, "count": n}
            for (c, m, label), (units, n) in sorted(totals.items(), key=lambda item: (-item[1][0], -item[1][1],
                                                                                      item[0]))]


def _cells(acts: Any, config: Any) -> int:
    from randattn.analysis.sweep_plan import count_cells

    try:
        return count_cells(acts, config)
    except (TypeError, ValueError, AttributeError):  # a caller's own ``sweep`` may take activations of its own kind
        return 1


def _activation_summary(acts: Any) -> Mapping[str, Any]:
    metadata = getattr(acts, "metadata", {}) or {}
    keep = ("model", "source", "images", "input_size", "layers", "scale", "tokens")
    return {key: metadata.get(key) for key in keep if key in metadata} | {"shape": list(acts.shape)}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("randattn")
    except PackageNotFoundError:  # a source tree that is not installed
        return "unknown"
