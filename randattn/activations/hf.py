"""Capture Q, K, V from Hugging Face ``transformers`` ViT-family vision models through forward hooks.

The counterpart of :mod:`randattn.activations.torch_vit` (timm) for ``transformers`` checkpoints: ``ViTModel``,
``DeiTModel``, ``Dinov2Model`` (with or without registers), ``CLIPVisionModel`` / the vision tower of
``CLIPModel``, ``SiglipVisionModel`` and ``ViTMSNModel``. Their attention modules project the hidden states with
three separate linears (``q_proj``/``k_proj``/``v_proj`` in transformers >= 5, ``query``/``key``/``value`` in
older releases), split them into heads, and call an attention kernel with the module's ``scaling`` (or
``scale``) as the temperature. The hooks read

* the outputs of the three projections ``(B, N, H * D)`` -> raw q, k, v ``(B, H, N, D)``, i.e. before the
  kernel multiplies by the scale (none of these architectures normalises q or k);
* optionally the input of the output projection (``o_proj`` / ``out_proj``; in older releases the self-attention
  module's own output), which is the attention output ``softmax(scale q k^T) v`` as ``(B, N, H * D)``.

Architectures that add anything to the logits (BEiT's relative position bias, Swin's windows) or drop tokens
(ViT-MAE's random masking) are refused: the captured q, k would not reproduce their attention.

Model names are passed to ``from_pretrained``: a local folder (``save_pretrained`` output) always works; a hub
name such as ``facebook/dinov2-small`` works where the model is in the Hugging Face cache or the hub is reachable.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Callable, Iterable

import numpy as np

from randattn.activations._capture import hooked_layers_and_scale, join_images, run_per_image
from randattn.activations.dinov2 import parse_layers
from randattn.activations.images import IMAGENET_MEAN, IMAGENET_STD, NamedImage, load_images, preprocess
from randattn.activations.io import Activations, _version, make_activations

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "attention_modules",
    "load_hf_model",
    "hf_preprocessing",
    "capture_hf_attention",
    "capture_hf",
    "hf_num_layers",
]

_MISSING_TRANSFORMERS = 'the Hugging Face capture needs transformers: pip install "randattn[hf]"'
#: ``config.model_type`` values whose attention is plain ``softmax(scale q k^T) v`` over every token
SUPPORTED_MODEL_TYPES: tuple[str, ...] = (
    "vit", "deit", "dinov2", "dinov2_with_registers", "vit_msn", "clip", "clip_vision_model", "siglip",
    "siglip_vision_model",
)  # fmt: skip
#: names of the (query, key, value) projections: transformers >= 5, then the 4.x ViT family
_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"))
_OUTPUT_PROJECTIONS = ("o_proj", "out_proj")


def _projections(module) -> tuple | None:
    import torch

    for names in _PROJECTIONS:
        found = [getattr(module, name, None) for name in names]
        if all(isinstance(linear, torch.nn.Linear) for linear in found):
            return tuple(found)
    return None


def attention_modules(model) -> list:
    """The model's self-attention modules (separate q/k/v linear projections), in module order.

    Parameters
    ----------
    model : torch.nn.Module
        A vision model (for ``CLIPModel`` pass its ``vision_model``; :func:`load_hf_model` does).

    Returns
    -------
    list of torch.nn.Module
    """
    return [module for module in model.modules() if _projections(module) is not None]


def _scale(module, head_dim: int) -> float:
    """The temperature the module passes to its attention kernel (``scaling``, ``scale``; 4.x: ``1/sqrt(D)``)."""
    for name in ("scaling", "scale"):
        value = getattr(module, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return float(head_dim) ** -0.5


def _num_heads(module, config) -> int:
    for name in ("num_heads", "num_attention_heads"):
        value = getattr(module, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return int(config.num_attention_heads)


def _vision_config(config):
    return getattr(config, "vision_config", None) or config


def _transformers():
    try:
        import transformers
    except ImportError as exc:
        raise ModuleNotFoundError(_MISSING_TRANSFORMERS, name="transformers") from exc
    return transformers


def _supported_config(where: str, local_files_only: bool):
    """The checkpoint's config (its JSON only, no weights); ValueError when unreadable or not a supported ViT."""
    try:
        config = _transformers().AutoConfig.from_pretrained(where, local_files_only=local_files_only)
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"cannot load a transformers config from {where!r} (a local save_pretrained folder, or a hub name "
            f"that is cached or reachable): {exc}"
        ) from exc
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{where!r} is a {config.model_type!r} model; the HF capture supports model types "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (plain softmax attention without logit biases or token dropping); "
            "decoder language models go through randattn.activations.lm"
        )
    return config


def hf_num_layers(name_or_path: str | os.PathLike, *, local_files_only: bool = False) -> int:
    """The attention layers of a ``transformers`` ViT from its config (``num_hidden_layers`` of its vision tower),
    without loading its weights: a layer selection is checked against it before the load.

    Raises
    ------
    ModuleNotFoundError
        transformers is missing.
    ValueError
        As :func:`load_hf_model`, for the config.
    """
    config = _supported_config(os.fspath(name_or_path), local_files_only)
    return int(_vision_config(config).num_hidden_layers)


def load_hf_model(name_or_path: str | os.PathLike, *, local_files_only: bool = False):
    """Load a ``transformers`` vision model (float32, eval mode) and return its vision tower.

    Parameters
    ----------
    name_or_path : str or path-like
        A folder written by ``save_pretrained`` or a hub name (needs the HF cache or network access).
    local_files_only : bool
        Never contact the hub.

    Returns
    -------
    torch.nn.Module
        The vision model (``CLIPModel.vision_model`` for a CLIP checkpoint), with ``config`` attached.

    Raises
    ------
    ModuleNotFoundError
        transformers is missing (the message names ``pip install "randattn[hf]"``).
    ValueError
        The model cannot be loaded, or its ``model_type`` is not in :data:`SUPPORTED_MODEL_TYPES`.
    """
    transformers = _transformers()
    where = os.fspath(name_or_path)
    config = _supported_config(where, local_files_only)
    try:
        model = transformers.AutoModel.from_pretrained(where, local_files_only=local_files_only)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load transformers model {where!r}: {exc}") from exc
    vision = getattr(model, "vision_model", None)
    if vision is not None and not hasattr(vision, "config"):
        vision.config = _vision_config(config)
    model = vision if vision is not None else model
    return model.float().eval()


def hf_preprocessing(name_or_path: str | os.PathLike, config=None) -> dict[str, Any]:
    """Mean, std and input side from the checkpoint's ``preprocessor_config.json`` (ImageNet/config otherwise).

    Returns
    -------
    dict
        ``{"mean": (3 floats), "std": (3 floats), "size": int or None, "from": str}``.
    """
    found: dict[str, Any] = {}
    try:
        from transformers.image_processing_utils import ImageProcessingMixin

        found, _ = ImageProcessingMixin.get_image_processor_dict(os.fspath(name_or_path))
        source = "preprocessor_config.json"
    except Exception:  # no processor file, or an old transformers: the documented defaults apply
        source = "ImageNet defaults (no preprocessor_config.json)"
    size = None
    for key in ("crop_size", "size"):
        value = found.get(key)
        if isinstance(value, dict):
            value = value.get("height", value.get("shortest_edge"))
        if isinstance(value, int):
            size = value
            break
    if size is None and config is not None:
        size = getattr(_vision_config(config), "image_size", None)
    return {
        "mean": tuple(float(x) for x in found.get("image_mean", IMAGENET_MEAN)),
        "std": tuple(float(x) for x in found.get("image_std", IMAGENET_STD)),
        "size": int(size) if isinstance(size, int) else None,
        "from": source,
    }


def capture_hf_attention(
    model,
    pixels: np.ndarray,
    layers: str | Iterable[int] | None = "all",
    *,
    attention_output: bool = False,
) -> dict:
    """Run ``model`` on ``pixels`` once and return hooked q, k, v (and optionally the attention output).

    Parameters
    ----------
    model : torch.nn.Module
        A vision model from :func:`load_hf_model` (or any module with ``config`` whose attention modules have
        separate q/k/v linears).
    pixels : ndarray of float32, shape (B, 3, S, S)
    layers : "all", "0,5,11", or ints
        Indices into :func:`attention_modules`.
    attention_output : bool
        Also return ``"attn"``: the input of the output projection, reshaped ``(B, H, N, D)``.

    Returns
    -------
    dict
        ``{layer: {"q", "k", "v"[, "attn"]: ndarray (B, H, N, D)}, "scale": {layer: float}}``.
    """
    import torch

    modules = attention_modules(model)
    if not modules:
        raise ValueError("model has no attention module with separate q/k/v linear projections")
    config = _vision_config(model.config)
    layers = parse_layers(layers, num_layers=len(modules))
    captured: dict[int, dict[str, np.ndarray]] = {layer: {} for layer in layers}
    heads = {layer: _num_heads(modules[layer], config) for layer in layers}

    def _split(layer, t):  # (B, N, H * D) -> (B, H, N, D)
        b, n, _ = t.shape
        return t.detach().reshape(b, n, heads[layer], -1).permute(0, 2, 1, 3).float().cpu().numpy().copy()

    handles = []
    for layer in layers:
        attn = modules[layer]
        for role, linear in zip("qkv", _projections(attn)):

            def hook(module, args, output, layer=layer, role=role):
                captured[layer][role] = _split(layer, output)

            handles.append(linear.register_forward_hook(hook))
        if attention_output:
            out_proj = next((getattr(attn, n) for n in _OUTPUT_PROJECTIONS if hasattr(attn, n)), None)
            if out_proj is not None:

                def pre_hook(module, args, layer=layer):
                    captured[layer]["attn"] = _split(layer, args[0])

                handles.append(out_proj.register_forward_pre_hook(pre_hook))
            else:  # transformers 4.x: the self-attention module returns (context, probs); its sibling projects

                def out_hook(module, args, output, layer=layer):
                    captured[layer]["attn"] = _split(layer, output[0] if isinstance(output, tuple) else output)

                handles.append(attn.register_forward_hook(out_hook))
    kwargs = {}
    image_size = getattr(config, "image_size", None)
    if "interpolate_pos_encoding" in inspect.signature(model.forward).parameters and image_size != pixels.shape[-1]:
        kwargs["interpolate_pos_encoding"] = True
    try:
        with torch.no_grad():
            model(pixel_values=torch.from_numpy(np.ascontiguousarray(pixels, dtype=np.float32)), **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    scales = {layer: _scale(modules[layer], captured[layer]["q"].shape[-1]) for layer in layers}
    return {**captured, "scale": scales}


def capture_hf(
    model,
    images: str | list[NamedImage],
    size: int | None = None,
    layers: str | Iterable[int] | None = "all",
    *,
    name: str = "hf",
    preprocessing: dict[str, Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Activations:
    """Capture q, k, v of a ``transformers`` ViT on ``images``.

    Parameters
    ----------
    model : torch.nn.Module
        From :func:`load_hf_model`.
    images : str or list of NamedImage
    size : int, optional
        Square input side in pixels; default the processor's crop size or ``config.image_size``. Sides other
        than the training size use the model's position-embedding interpolation.
    layers : "all", "0,5,11", or ints
    name : str
        The name or folder the model was loaded from (recorded in the metadata).
    preprocessing : dict, optional
        From :func:`hf_preprocessing` (default: ImageNet mean/std).
    progress : callable(done, total), optional

    Returns
    -------
    Activations
        ``(B, H, N, D)`` float32 with the modules' own scale; metadata ``grid: [h, w]`` (patch rows, columns) and
        ``prefix_tokens`` (CLS, distillation and register tokens, first on the token axis), with
        ``tokens == prefix_tokens + h * w``.
    """
    config = _vision_config(model.config)
    preprocessing = dict(preprocessing or {"mean": IMAGENET_MEAN, "std": IMAGENET_STD, "size": None,
                                           "from": "ImageNet defaults"})
    if isinstance(images, str):
        images = load_images(images)
    size = size or preprocessing.get("size") or getattr(config, "image_size", None)
    patch = getattr(config, "patch_size", None)
    patch = patch[0] if isinstance(patch, (list, tuple)) else patch
    if not isinstance(size, int) or not isinstance(patch, int) or size < patch:
        raise ValueError(f"size must be an int of at least the patch size {patch!r}, got {size!r}")
    per_image = run_per_image(images, lambda image: capture_hf_attention(
        model, preprocess([image], size, preprocessing["mean"], preprocessing["std"]), layers), progress)
    chosen, scale = hooked_layers_and_scale(per_image)
    arrays = join_images(per_image, chosen)
    tokens = arrays[chosen[0]][0].shape[2]
    grid = [size // patch, size // patch]
    prefix = tokens - grid[0] * grid[1]
    if prefix < 0:
        raise ValueError(f"{name}: {tokens} tokens is fewer than the {grid[0]} x {grid[1]} patch grid")
    metadata = {
        "model": f"hf:{name}",
        "source": f"transformers {config.model_type} forward hooks on q/k/v projections",
        "scale": scale,
        "images": [image.name for image in images],
        "input_size": [size, size],
        "preprocess": f"PIL ImageOps.fit bicubic (shorter side to size, center crop), mean/std from "
                      f"{preprocessing.get('from', 'ImageNet defaults')}",
        "layers": chosen,
        "grid": grid,
        "prefix_tokens": prefix,
        "randattn_version": _version(),
    }
    return make_activations(arrays, metadata, where=f"hf capture of {name}")
