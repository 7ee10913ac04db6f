"""Capture Q, K, V from timm-style torch ViTs through forward hooks on their attention modules.

A module counts as an attention layer when it has a fused ``qkv`` linear, ``num_heads`` and ``scale`` (timm's
``Attention``, used by ``VisionTransformer``, DeiT, ...). Layers are numbered in module order. The hooks read:

* ``qkv`` output ``(B, N, 3 * H * D)`` -> reshaped ``(B, N, 3, H, D)`` and split into raw q, k, v ``(B, H, N, D)``;
* ``q_norm`` / ``k_norm`` outputs (where the module has them; identity otherwise), so that q, k are what the
  model's softmax actually sees, before the module multiplies by ``scale``;
* optionally the input of ``proj`` (the attention output ``softmax(scale q k^T) v`` as ``(B, N, H * D)``; only
  equal to it when the module has no ``scale_norm``/gate, as in plain ViTs).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from randattn.activations._capture import hooked_layers_and_scale, join_images, run_per_image
from randattn.activations.dinov2 import parse_layers
from randattn.activations.images import IMAGENET_MEAN, IMAGENET_STD, NamedImage, load_images, preprocess
from randattn.activations.io import Activations, _version, make_activations

__all__ = ["attention_modules", "capture_torch_attention", "load_timm_model", "capture_timm"]

_MISSING_TIMM = (
    'the timm capture needs timm: pip install "randattn[timm]" (timm imports torchvision; without a torchvision '
    "that matches your torch, import timm fails)"
)


def _timm_import_error(exc: ImportError) -> ModuleNotFoundError:
    """What ``import timm`` failing means: timm missing, or timm installed and a module it imports missing (named
    by ``exc.name``: torchvision, beside a timm installed with ``--no-deps``)."""
    import importlib.util

    import torch

    if importlib.util.find_spec("timm") is None:
        return ModuleNotFoundError(_MISSING_TIMM, name="timm")
    missing = (exc.name or "").partition(".")[0]
    if missing in ("", "timm"):  # timm is there but broken in itself
        return ModuleNotFoundError(f"timm is installed, but importing it failed ({exc}); {_MISSING_TIMM}", name="timm")
    how = (f"install the torchvision release built for your torch {torch.__version__} (pytorch.org lists the "
           "pip command for your platform)" if missing == "torchvision" else f"pip install {missing}")
    return ModuleNotFoundError(f"the timm capture needs {missing}, which timm imports: timm is installed but "
                               f"{missing} is not ({exc}); {how}", name=missing)


def attention_modules(model) -> list:
    """The model's attention modules (those with ``qkv``, ``num_heads`` and ``scale``), in module order."""
    return [
        module
        for module in model.modules()
        if hasattr(module, "qkv") and hasattr(module, "num_heads") and hasattr(module, "scale")
    ]


def capture_torch_attention(
    model,
    pixels: np.ndarray,
    layers: str | Iterable[int] | None = "all",
    *,
    attention_output: bool = False,
) -> dict[int, dict[str, np.ndarray]]:
    """Run ``model`` on ``pixels`` once and return hooked q, k, v (and optionally the attention output).

    Parameters
    ----------
    model : torch.nn.Module
        A timm-style ViT in eval mode.
    pixels : ndarray of float32, shape (B, 3, S, S)
    layers : "all", "0,5,11", or ints
        Indices into :func:`attention_modules`.
    attention_output : bool
        Also return ``"attn"``: the input of the module's ``proj``, reshaped ``(B, H, N, D)``.

    Returns
    -------
    dict
        ``{layer: {"q", "k", "v"[, "attn"]: ndarray (B, H, N, D)}, "scale": {layer: float}}`` -- the scale of
        each layer under the key ``"scale"``.
    """
    import torch

    modules = attention_modules(model)
    if not modules:
        raise ValueError("model has no timm-style attention module (with qkv, num_heads and scale attributes)")
    layers = parse_layers(layers, num_layers=len(modules))
    captured: dict[int, dict[str, np.ndarray]] = {layer: {} for layer in layers}
    handles = []

    def _heads(module, t):  # (B, N, H * D) -> (B, H, N, D)
        b, n, _ = t.shape
        return t.reshape(b, n, module.num_heads, -1).permute(0, 2, 1, 3)

    def _store(layer, role):
        def hook(module, args, output):
            captured[layer][role] = output.detach().float().cpu().numpy().copy()

        return hook

    for layer in layers:
        attn = modules[layer]

        def qkv_hook(module, args, output, layer=layer, attn=attn):
            b, n, _ = output.shape
            q, k, v = output.detach().reshape(b, n, 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
            for role, t in zip("qkv", (q, k, v)):
                captured[layer].setdefault(role, t.float().cpu().numpy().copy())

        handles.append(attn.qkv.register_forward_hook(qkv_hook))
        # q_norm / k_norm run after the split; their outputs replace the raw q, k
        for role in ("q", "k"):
            norm = getattr(attn, f"{role}_norm", None)
            if isinstance(norm, torch.nn.Module):
                handles.append(norm.register_forward_hook(_store(layer, role)))
        if attention_output:

            def proj_hook(module, args, layer=layer, attn=attn):
                captured[layer]["attn"] = _heads(attn, args[0].detach()).float().cpu().numpy().copy()

            handles.append(attn.proj.register_forward_pre_hook(proj_hook))
    try:
        with torch.no_grad():
            model(torch.from_numpy(np.ascontiguousarray(pixels, dtype=np.float32)))
    finally:
        for handle in handles:
            handle.remove()
    scales = {layer: float(modules[layer].scale) for layer in layers}
    return {**captured, "scale": scales}


def load_timm_model(
    name: str, checkpoint: str | os.PathLike | None, *, img_size: int | None = None, **model_kwargs
):
    """Create timm model ``name`` (no hub access) and load weights from a local ``checkpoint`` file.

    Parameters
    ----------
    name : str
        A timm architecture name, e.g. ``"vit_small_patch16_224"``.
    checkpoint : path or None
        Local ``.pth``/``.safetensors`` state dict; None leaves random weights (tests only).
    img_size : int, optional
        Input size passed to ``timm.create_model``.
    **model_kwargs
        Further architecture arguments for ``timm.create_model`` (e.g. ``depth``, ``patch_size``).

    Returns
    -------
    torch.nn.Module
        In eval mode.
    """
    try:
        import timm
    except ImportError as exc:
        raise _timm_import_error(exc) from exc
    if checkpoint is not None and not Path(checkpoint).is_file():
        raise FileNotFoundError(f"checkpoint not found: {os.fspath(checkpoint)!r}")
    kwargs = dict(model_kwargs) if img_size is None else {**model_kwargs, "img_size": int(img_size)}
    try:
        model = timm.create_model(
            name, pretrained=False, checkpoint_path=os.fspath(checkpoint) if checkpoint else "", **kwargs
        )
    except RuntimeError as exc:  # timm raises RuntimeError for unknown names and bad state dicts
        raise ValueError(f"cannot build timm model {name!r} from {os.fspath(checkpoint)!r}: {exc}") from exc
    return model.eval()


def capture_timm(
    model,
    images: str | list[NamedImage],
    size: int | None = None,
    layers: str | Iterable[int] | None = "all",
    *,
    name: str = "timm",
    checkpoint: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Activations:
    """Capture q, k, v of a timm ViT on ``images``.

    Parameters
    ----------
    model : torch.nn.Module
        From :func:`load_timm_model`.
    images : str or list of NamedImage
    size : int, optional
        Input side; default the model's ``pretrained_cfg`` input size.
    layers : "all", "0,5,11", or ints
    name, checkpoint : str
        Recorded in the metadata.
    progress : callable(done, total), optional

    Returns
    -------
    Activations
        ``(B, H, N, D)`` float32 with the modules' own ``scale``.
    """
    if isinstance(images, str):
        images = load_images(images)
    cfg = getattr(model, "pretrained_cfg", None) or {}
    if size is None:
        size = int(cfg.get("input_size", (3, 224, 224))[-1])
    mean, std = tuple(cfg.get("mean", IMAGENET_MEAN)), tuple(cfg.get("std", IMAGENET_STD))
    per_image = run_per_image(
        images, lambda image: capture_torch_attention(model, preprocess([image], size, mean, std), layers), progress)
    chosen, scale = hooked_layers_and_scale(per_image)
    arrays = join_images(per_image, chosen)
    metadata = {
        "model": f"timm:{name}",
        "source": f"timm forward hooks, checkpoint {checkpoint!r}",
        "scale": scale,
        "images": [image.name for image in images],
        "input_size": [size, size],
        "layers": chosen,
        "randattn_version": _version(),
        **_token_layout(model, size, arrays[chosen[0]][0].shape[2]),
    }
    return make_activations(arrays, metadata, where=f"timm capture of {name}")


def _token_layout(model, size: int, tokens: int) -> dict:
    """``{"prefix_tokens": P, "grid": [h, w]}`` from timm's ``num_prefix_tokens`` and ``patch_embed``.

    The grid is the patch grid of a ``size x size`` input (``patch_embed.grid_size`` when ``size`` is the
    model's own input size, ``size // patch_size`` otherwise); recorded only when ``P + h w`` equals the
    captured token count (models that pool or drop tokens get no layout, i.e. 1-D behaviour).
    """
    embed = getattr(model, "patch_embed", None)
    prefix = getattr(model, "num_prefix_tokens", None)
    if embed is None or prefix is None:
        return {}
    patch = getattr(embed, "patch_size", None)
    grid = getattr(embed, "grid_size", None)
    img = getattr(embed, "img_size", None)
    if patch is not None and (img is None or tuple(img) != (size, size)):
        ph, pw = (patch, patch) if isinstance(patch, int) else tuple(patch)
        grid = (size // ph, size // pw)
    if grid is None:
        return {}
    h, w = int(grid[0]), int(grid[1])
    if int(prefix) + h * w != tokens:
        return {}
    return {"prefix_tokens": int(prefix), "grid": [h, w]}
