"""``randattn capture``: model + images -> activation file (q, k, v per layer)."""

from __future__ import annotations

import click

from randattn.cli._common import abort as _abort_markup
from randattn.cli._common import err_console, out_console, writable_output

_VIT_EXTRA = 'this needs the "vit" extra: pip install "randattn[vit]"'


def abort(message: str):
    """Exit 2 with ``message`` (shown literally: :func:`randattn.cli._common.abort` escapes rich markup)."""
    _abort_markup(message)


@click.command("capture")
@click.option("--model", "model_name", default="dinov2-s14", show_default=True,
              type=click.Choice(["dinov2-s14"]), help="Bundled model (ignored with --timm or --hf).")
@click.option("--timm", "timm_name", default=None, help="A timm architecture name, e.g. vit_small_patch16_224.")
@click.option("--checkpoint", type=click.Path(dir_okay=False), default=None,
              help="Local weights for --timm (no hub access).")
@click.option("--hf", "hf_name", default=None, metavar="PATH_OR_NAME",
              help="A Hugging Face transformers ViT (ViT, DeiT, DINOv2, CLIP/SigLIP vision): a save_pretrained "
                   "folder, or a hub name such as facebook/dinov2-small where it is cached or the hub is reachable.")
@click.option("--images", "images_spec", default="skimage:astronaut,coffee", show_default=True,
              help="'skimage:NAME,NAME', a folder of PNG/JPEG files, or one image file.")
@click.option("--size", type=int, default=None,
              help="Input side in pixels, a multiple of 14 for dinov2-s14: 196, 336, 392 -> 197, 577, 785 tokens "
                   "(default 196; for --timm and --hf the model's own size).")
@click.option("--layers", default="all", show_default=True, help="'all' or comma-separated indices, e.g. 0,5,11.")
@click.option("--dtype", type=click.Choice(["float32", "float16"]), default="float32", show_default=True)
@click.option("--out", "out_path", type=click.Path(dir_okay=False), required=True,
              help="Output file: .safetensors (recommended), .npz or .pt.")
def command(model_name, timm_name, checkpoint, hf_name, images_spec, size, layers, dtype, out_path):
    """Capture q, k, v of a ViT's attention layers on images and write them to an activation file."""
    from pathlib import Path

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from randattn.activations.io import FORMATS, save_activations

    if Path(out_path).suffix.lower() not in FORMATS:
        abort(f"--out must end in one of {', '.join(sorted(FORMATS))}, got {out_path!r}")
    if timm_name is not None and hf_name is not None:
        abort("use either --timm NAME or --hf PATH_OR_NAME, not both")
    if timm_name is None and checkpoint is not None:
        abort("--checkpoint is only used with --timm NAME")
    if timm_name is not None and checkpoint is None:
        abort("--timm needs --checkpoint PATH (a local weights file; there is no hub access)")
    if size is not None and size <= 0:
        abort(f"--size must be positive, got {size}")
    if timm_name is None and hf_name is None and size is not None and size % 14:
        abort(f"--size must be a multiple of 14 for dinov2-s14 (e.g. 196, 336, 392), got {size}")
    writable_output(out_path)  # before loading the model and capturing

    try:
        from randattn.activations.images import load_images

        images = load_images(images_spec)
    except ModuleNotFoundError:
        abort(f"reading images: {_VIT_EXTRA}")
    except (ValueError, FileNotFoundError) as exc:
        abort(str(exc))

    with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err_console, transient=False) as progress:
        task = progress.add_task("loading model", total=len(images))

        def advance(done: int, total: int) -> None:
            progress.update(task, completed=done, description="capturing")

        try:
            if hf_name is not None:
                from randattn.activations.hf import capture_hf, hf_preprocessing, load_hf_model

                model = load_hf_model(hf_name)
                progress.update(task, description="capturing")
                acts = capture_hf(model, images, size, layers, name=hf_name,
                                  preprocessing=hf_preprocessing(hf_name, model.config), progress=advance)
            elif timm_name is None:
                from randattn.activations.dinov2 import Dinov2Onnx, capture_dinov2, parse_layers

                chosen = parse_layers(layers)
                model = Dinov2Onnx()
                progress.update(task, description="capturing")
                acts = capture_dinov2(images, size or 196, chosen, model=model, progress=advance)
            else:
                from randattn.activations.torch_vit import capture_timm, load_timm_model

                model = load_timm_model(timm_name, checkpoint, img_size=size)
                progress.update(task, description="capturing")
                acts = capture_timm(model, images, size, layers, name=timm_name, checkpoint=checkpoint,
                                    progress=advance)
        except ModuleNotFoundError as exc:
            if exc.name in ("timm", "transformers"):
                abort(str(exc))
            abort(f"{exc}; {_VIT_EXTRA}" if "randattn[vit]" not in str(exc) else str(exc))
        except (ValueError, FileNotFoundError) as exc:
            abort(str(exc))

    try:
        written = save_activations(acts, out_path, dtype=dtype)
    except (ValueError, OSError) as exc:
        abort(f"writing {out_path!r}: {exc}")
    b, h, n, d = acts.shape
    size_mb = written.stat().st_size / 2**20
    err_console.print(
        f"wrote [bold]{written}[/]: {acts.metadata['model']}, layers {list(acts.layers)}, {b} image(s) x {h} heads "
        f"x {n} tokens x {d} head_dim, {dtype}, scale {acts.scale:g}, {size_mb:.1f} MiB",
        highlight=False,
    )
    out_console.print(str(written), highlight=False, soft_wrap=True)
