"""The language-model demo: capture Q/K/V from the bundled SmolLM2-135M on bundled text, sweep under its causal mask.

``run_demo_lm`` chains :func:`randattn.activations.lm.capture_lm` (one forward pass per text, stopped after the
last chosen layer), :func:`randattn.analysis.sweep.run_sweep_tables` under the mask the capture recorded (causal in
every SmolLM2 layer), :func:`randattn.analysis.sweep.write_tables`, the MSE-vs-samples and error-by-position figures
and the HTML report (with its language-model section). The capture is a parameter whose default is the bundled
model on the bundled text: a caller can measure activations captured before (``lambda config: load_activations(path)``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import pandas as pd

from randattn._validation import ParameterError
from randattn.workflows.demo import DemoResult, DemoStep, demo_metadata, demo_outputs, run_sweeps

__all__ = ["LMDemoConfig", "LM_DECODE", "LM_DECODE_QUICK", "LM_QUICK", "check_bundled_layers", "demo_lm_outputs",
           "run_demo_lm"]


@dataclass(frozen=True)
class LMDemoConfig:
    """What the language-model demo runs.

    Attributes
    ----------
    model : str
        A bundled language model (:data:`randattn.activations.lm.BUNDLED_LMS`).
    text : str
        Text spec (:func:`randattn.activations.lm.read_texts`); the default two pydoc topics give two sequences.
    max_tokens : int
        Tokens per sequence.
    layers : tuple of int
        Layers to capture and measure. The default three span the 30 of SmolLM2-135M; the capture runs the model
        up to the last of them, so the last layer costs a full forward pass.
    samples : tuple of int
        Sample counts S of ``estimators``.
    single_sample : tuple of int
        Sample counts of the ``ra`` estimators (RA costs O(N M S D), so small S only).
    replicates : int
        Replicates R per cell.
    estimators : tuple of str
        Specs run at every S in ``samples``.
    ra : tuple of str
        Specs run at the S in ``single_sample``.
    seed : int
    backend : {"torch", "reference"}
    pack : bool
        Join the texts into one sequence (:func:`randattn.activations.lm.pack_texts`): a long context.
    queries : str
        The query rows measured (``mse --queries``): ``"all"``, or ``"last:K"``, the decode regime.
    epsilon : float or None
        The relative-error bound of the violation columns (``mse --epsilon``); None: only promised ones.
    """

    model: str = "smollm2-135m"
    text: str = "pydoc:assignment,function"
    max_tokens: int = 512
    layers: tuple[int, ...] = (0, 14, 29)
    samples: tuple[int, ...] = (16, 64)
    single_sample: tuple[int, ...] = (1, 2)
    replicates: int = 8
    estimators: tuple[str, ...] = ("rfa:coupling=orthogonal", "eva")
    ra: tuple[str, ...] = ("ra",)
    seed: int = 0
    backend: str = "torch"
    pack: bool = False
    queries: str = "all"
    epsilon: float | None = None

    @property
    def decode(self) -> bool:
        """Whether this is the decode view: the last queries of a long cache."""
        return self.queries != "all"

    def __post_init__(self) -> None:
        """Every value the capture and the sweep would refuse, refused here: before the model loads.

        Raises
        ------
        ParameterError
            Naming the field (a command line names its option for it).
        """
        if self.max_tokens < 2:
            raise ParameterError("max_tokens", str(self.max_tokens), " must be at least 2")
        if not self.layers:
            raise ParameterError("layers", None, ": give at least one layer")
        for name in ("samples", "single_sample"):
            bad = [s for s in getattr(self, name) if s < 1]
            if bad:
                raise ParameterError(name, None, f": sample counts must be positive integers, got {bad}")
        if not self.samples and not (self.ra and self.single_sample):
            raise ValueError("nothing to measure: give samples or ra sample counts")
        if self.replicates < 2:
            raise ParameterError("replicates", str(self.replicates), " must be at least 2 (a variance needs two)")
        if self.decode and self.max_tokens < int(self.queries.split(":")[1]):
            raise ParameterError("max_tokens", str(self.max_tokens), f": the decode view measures the last "
                                 f"{self.queries.split(':')[1]} queries of the cache, so it needs at least that "
                                 "many tokens")


#: a seconds-long smoke test: 64 tokens, the first layer only, S = 4, 8, R = 3
LM_QUICK = LMDemoConfig(max_tokens=64, layers=(0,), samples=(4, 8), single_sample=(1,), replicates=3)

#: the decode view: the last 64 queries of a 4,096-token cache (the bundled documentation packed into one
#: sequence) in layers 0 and 15; top-k, StreamingLLM, Quest, vAttention with a fixed sample and Performer at budgets
#: of 1/64, 1/16 and 1/4 of the keys (64, 256, 1,024); MagicPIG at the paper's (K, L) = (10, 150) and vAttention at
#: its own (epsilon, delta) (``single_sample``: MagicPIG's S is L, vAttention's adaptive size ignores S): their budgets
#: are random, measured as keys used. The violation rate at epsilon = 0.1 for the estimators without a promise.
LM_DECODE = LMDemoConfig(
    text="pydoc:all", pack=True, max_tokens=4096, layers=(0, 15), samples=(64, 256, 1024),
    estimators=("topk", "streaming", "quest", "vattention:budget=fixed", "rfa:coupling=orthogonal"),
    single_sample=(150,), ra=("magicpig", "vattention"), replicates=4, queries="last:64", epsilon=0.1,
)
#: the decode view in seconds: 1,024 tokens, layer 0, budgets 16 and 64, R = 3
LM_DECODE_QUICK = dataclasses.replace(LM_DECODE, max_tokens=1024, layers=(0,), samples=(16, 64), single_sample=(16,),
                                      replicates=3)


def check_bundled_layers(config: LMDemoConfig) -> None:
    """Refuse layers the bundled model lacks, from its file's header: milliseconds, where loading it takes seconds.

    Raises
    ------
    ValueError
        A layer out of range, naming the model's layers.
    ModuleNotFoundError
        The bundled model's package is not installed.
    """
    from randattn.activations.lm import bundled_lm_size

    bundled_lm_size(config.model).check_layers(list(config.layers))


def _default_capture(config: LMDemoConfig):
    from randattn.activations.lm import capture_lm, load_bundled_lm, pack_texts, read_texts, tokenize_texts

    check_bundled_layers(config)
    texts = read_texts(config.text)
    texts = pack_texts(texts) if config.pack else texts
    # the GGUF loader draws its own tqdm bars on stderr, which would tear the caller's progress display
    with contextlib.redirect_stderr(io.StringIO()):
        lm = load_bundled_lm(config.model)
    ids, _ = tokenize_texts(lm.tokenizer, [t for _, t in texts], max_tokens=config.max_tokens)
    return capture_lm(lm, ids, list(config.layers), names=[name for name, _ in texts], text=config.text)


def demo_lm_outputs(table_name: str = "results.csv", formats: Sequence[str] = ("png", "svg"),
                    decode: bool = False) -> tuple[str, ...]:
    """The names of the files :func:`run_demo_lm` writes into its folder (with the same ``table_name`` and
    ``formats``; ``decode``: the decode view, which adds the error-vs-budget figure)."""
    from randattn.results.table import positions_path

    positions = positions_path(table_name).name
    budget = tuple(f"error-vs-budget.{fmt}" for fmt in formats) if decode else ()
    return (*demo_outputs(table_name, formats), positions, f"{positions}.meta.json",
            *(f"position.{fmt}" for fmt in formats), *budget)


def run_demo_lm(
    config: LMDemoConfig,
    out_dir: str | Path,
    *,
    command: str | None = None,
    progress: Callable[[DemoStep], None] | None = None,
    capture: Callable[[LMDemoConfig], Any] | None = None,
    table_name: str = "results.csv",
    formats: Sequence[str] = ("png", "svg"),
) -> DemoResult:
    """Capture, sweep under the recorded mask, and write table, figures and report to ``out_dir``.

    Parameters
    ----------
    config : LMDemoConfig
    out_dir : str or Path
        Created if missing; files in it of the same names (:func:`demo_lm_outputs`) are replaced
        (``randattn demo-lm`` refuses that without ``--force``).
    command : str, optional
        The command line, recorded in the metadata and the report.
    progress : callable(DemoStep), optional
    capture : callable(LMDemoConfig) -> Activations, optional
        Default: the bundled model on the bundled text.
    table_name : str
    formats : sequence of str

    Returns
    -------
    DemoResult
        ``files`` names ``table``, ``positions``, ``figure.<fmt>``, ``position.<fmt>`` and ``report``.

    Raises
    ------
    ModuleNotFoundError
        The bundled model's package is not installed (the message gives the install line).
    """
    from randattn.analysis.masking import masks_of_activations
    from randattn.results.summary import aggregate
    from randattn.analysis.plan import SweepConfig, parse_estimator_list
    from randattn.analysis.sweep_run import run_sweep_tables
    from randattn.results.table import SweepTables, positions_path, write_tables
    from randattn._files import named_write_errors
    from randattn.reports.figures import error_vs_budget_figure, mse_vs_samples_figure, position_figure, save_figure
    from randattn.reports.html import write_report

    if not isinstance(config, LMDemoConfig):
        raise TypeError(f"config must be an LMDemoConfig, got {type(config).__name__}")
    capture = _default_capture if capture is None else capture
    report = progress if progress is not None else (lambda step: None)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    seconds: dict[str, float] = {}
    start = time.perf_counter()

    report(DemoStep("capture", 0, 1))
    acts = capture(config)
    report(DemoStep("capture", 1, 1))
    seconds["capture"] = time.perf_counter() - start

    # the mask the model ran with (causal in SmolLM2), as `randattn mse` applies it by default (--mask file)
    mask = masks_of_activations(acts)
    common = dict(replicates=config.replicates, seed=config.seed, backend=config.backend, mask=mask,
                  queries=config.queries, epsilon=config.epsilon)
    sweep_configs = []
    if config.samples and config.estimators:
        sweep_configs.append(SweepConfig(estimators=parse_estimator_list(list(config.estimators)),
                                         num_samples=tuple(config.samples), **common))
    if config.single_sample and config.ra:
        sweep_configs.append(SweepConfig(estimators=parse_estimator_list(list(config.ra)),
                                         num_samples=tuple(config.single_sample), **common))
    results = run_sweeps(run_sweep_tables, acts, sweep_configs, report, "sweep")
    table = pd.concat([r.table for r in results], ignore_index=True)
    position_parts = [r.positions for r in results if r.positions is not None]
    positions = pd.concat(position_parts, ignore_index=True) if position_parts else None
    seconds["sweep"] = time.perf_counter() - start - seconds["capture"]

    report(DemoStep("report", 0, 1))
    t_report = time.perf_counter()
    fields = ("model", "layers", "heads", "head_dim", "tokens", "images", "scale", "source", "layout",
              "architecture", "kv_heads", "head_map", "mask", "sliding_window", "weights", "text", "add_bos")
    # activations: a mapping (not the ViT demo's list): the report's language-model section reads it
    metadata = demo_metadata(config, command, sweep_configs, table, [r.table for r in results],
                             activations={k: acts.metadata.get(k) for k in fields})
    with named_write_errors(out / table_name):
        written = write_tables(SweepTables(table, positions), out / table_name, metadata)
    files = {"table": written[0], "metadata": written[1]}
    if positions is not None:
        files["positions"] = positions_path(out / table_name)
    for path in save_figure(mse_vs_samples_figure(table, metadata=metadata), out / "mse-vs-samples", formats):
        files[f"figure.{path.suffix[1:]}"] = path
    if config.decode:
        for path in save_figure(error_vs_budget_figure(table, metadata=metadata), out / "error-vs-budget", formats):
            files[f"error-vs-budget.{path.suffix[1:]}"] = path
    if positions is not None:
        figure = position_figure(positions, metadata=metadata, num_samples=int(positions["num_samples"].max()))
        for path in save_figure(figure, out / "position", formats):
            files[f"position.{path.suffix[1:]}"] = path
    seconds["report"] = time.perf_counter() - t_report
    seconds["total"] = time.perf_counter() - start
    metadata["seconds"] = {k: round(v, 1) for k, v in seconds.items()}
    files["report"] = write_report(table, out, metadata=metadata, command=command, positions=positions)
    seconds["report"] = time.perf_counter() - t_report
    seconds["total"] = time.perf_counter() - start
    report(DemoStep("report", 1, 1))
    return DemoResult(table=table, summary=aggregate(table, seed=config.seed), files=files, seconds=seconds)
