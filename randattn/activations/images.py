"""Images with no download: scikit-image's bundled pictures, a folder of the user's images, or one file.

Spec strings: ``"skimage:astronaut,coffee"`` | a directory (its ``.png``/``.jpg``/``.jpeg`` files, sorted by name)
| a single image file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "SKIMAGE_IMAGES",
    "NamedImage",
    "load_images",
    "preprocess",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
#: scikit-image pictures that ship inside the wheel (no pooch download); gray ones are converted to RGB
SKIMAGE_IMAGES = (
    "astronaut", "brick", "camera", "cat", "cell", "chelsea", "clock", "coffee", "coins", "colorwheel", "grass",
    "gravel", "horse", "hubble_deep_field", "immunohistochemistry", "logo", "microaneurysms", "moon", "page",
    "retina", "rocket", "text",
)  # fmt: skip
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")


@dataclass(frozen=True)
class NamedImage:
    """An RGB image and its name.

    Attributes
    ----------
    name : str
        ``"skimage:astronaut"`` or the file name.
    pixels : ndarray of uint8, shape (height, width, 3)
    """

    name: str
    pixels: np.ndarray


def load_images(spec: str) -> list[NamedImage]:
    """Load the images named by ``spec``.

    Parameters
    ----------
    spec : str
        ``"skimage:NAME[,NAME...]"`` (names from :data:`SKIMAGE_IMAGES`), a directory, or an image file.

    Returns
    -------
    list of NamedImage
        RGB uint8 images ``(height, width, 3)``, in the order given (directories: sorted by file name).

    Raises
    ------
    ValueError
        Unknown scikit-image name, empty folder, unreadable or non-image file.
    FileNotFoundError
        The path does not exist.
    """
    kind, payload = _load_images_iv(spec)
    if kind == "skimage":
        return [_skimage_image(name) for name in payload]
    return [_file_image(p) for p in payload]


def _load_images_iv(spec: object) -> tuple[str, list]:
    if not isinstance(spec, str):
        raise TypeError(f"images must be a str spec, got {type(spec).__name__}")
    if spec.startswith("skimage:"):
        names = [n.strip() for n in spec[len("skimage:") :].split(",") if n.strip()]
        if not names:
            raise ValueError(f"images: {spec!r} names no image; e.g. 'skimage:astronaut,coffee'")
        unknown = [n for n in names if n not in SKIMAGE_IMAGES]
        if unknown:
            raise ValueError(
                f"images: unknown scikit-image picture(s) {unknown}; bundled ones are: {', '.join(SKIMAGE_IMAGES)}"
            )
        return "skimage", names
    path = Path(spec).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"images: no such file or folder: {spec!r} (or use 'skimage:astronaut,coffee')")
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
        if not files:
            raise ValueError(f"images: folder {spec!r} holds no {'/'.join(IMAGE_SUFFIXES)} files")
        return "files", files
    return "files", [path]


def _skimage_image(name: str) -> NamedImage:
    import skimage.data

    return NamedImage(f"skimage:{name}", _to_rgb_uint8(np.asarray(getattr(skimage.data, name)())))


def _file_image(path: Path) -> NamedImage:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            rgb = np.asarray(img.convert("RGB"))
    except (UnidentifiedImageError, OSError) as exc:
        raise ValueError(f"images: cannot read {os.fspath(path)!r} as an image: {exc}") from exc
    return NamedImage(path.name, rgb)


def _to_rgb_uint8(a: np.ndarray) -> np.ndarray:
    if a.dtype == bool:
        a = a.astype(np.uint8) * 255
    a = a.astype(np.uint8, copy=False)
    if a.ndim == 2:
        return np.repeat(a[:, :, None], 3, axis=2)
    if a.shape[2] == 4:  # RGBA (skimage's logo): drop alpha
        return np.ascontiguousarray(a[:, :, :3])
    return a


def preprocess(
    images: list[NamedImage],
    size: int,
    mean: tuple[float, float, float] = IMAGENET_MEAN,
    std: tuple[float, float, float] = IMAGENET_STD,
) -> np.ndarray:
    """Resize (shorter side to ``size``, bicubic), center-crop to ``size x size`` and normalise.

    Parameters
    ----------
    images : list of NamedImage
    size : int
        Output height and width in pixels.
    mean, std : tuple of 3 floats
        Per-channel normalisation of ``[0, 1]`` pixel values (ImageNet by default).

    Returns
    -------
    ndarray of float32, shape (B, 3, size, size)
    """
    from PIL import Image, ImageOps

    if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or size <= 0:
        raise ValueError(f"size must be a positive int, got {size!r}")
    if len(images) == 0:
        raise ValueError("images must hold at least one image")
    m = np.asarray(mean, dtype=np.float32)[:, None, None]
    s = np.asarray(std, dtype=np.float32)[:, None, None]
    batch = []
    for image in images:
        fitted = ImageOps.fit(Image.fromarray(image.pixels), (int(size), int(size)), method=Image.Resampling.BICUBIC)
        chw = np.asarray(fitted, dtype=np.float32).transpose(2, 0, 1) / 255.0
        batch.append((chw - m) / s)
    return np.stack(batch).astype(np.float32, copy=False)
