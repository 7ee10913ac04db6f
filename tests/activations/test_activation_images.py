"""Image specs: scikit-image's bundled pictures, a folder, a single file."""

from __future__ import annotations

import numpy as np
import pytest

from randattn.activations.images import load_images, preprocess

pytest.importorskip("skimage")
Image = pytest.importorskip("PIL.Image")


def test_skimage_color_and_gray_become_rgb():
    images = load_images("skimage:astronaut, camera,logo")
    assert [i.name for i in images] == ["skimage:astronaut", "skimage:camera", "skimage:logo"]
    for image in images:
        assert image.pixels.ndim == 3 and image.pixels.shape[2] == 3 and image.pixels.dtype == np.uint8
    gray = images[1].pixels
    np.testing.assert_array_equal(gray[..., 0], gray[..., 2])


def test_folder_and_file(tmp_path):
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (20, 30, 3), dtype=np.uint8)).save(tmp_path / "b.png")
    Image.fromarray(rng.integers(0, 255, (25, 25), dtype=np.uint8)).save(tmp_path / "a.jpg")
    (tmp_path / "notes.txt").write_text("not an image")
    images = load_images(str(tmp_path))
    assert [i.name for i in images] == ["a.jpg", "b.png"]
    assert images[0].pixels.shape == (25, 25, 3)
    (single,) = load_images(str(tmp_path / "b.png"))
    assert single.pixels.shape == (20, 30, 3)


@pytest.mark.parametrize(
    ("spec", "error", "message"),
    [
        ("skimage:astronaut,unicorn", ValueError, r"unknown scikit-image picture\(s\) \['unicorn'\]"),
        ("skimage:", ValueError, "names no image"),
        ("/no/such/dir", FileNotFoundError, "no such file or folder: '/no/such/dir'"),
    ],
)
def test_bad_specs(spec, error, message):
    with pytest.raises(error, match=message):
        load_images(spec)


def test_empty_folder_and_bad_file(tmp_path):
    with pytest.raises(ValueError, match="holds no .png/.jpg/.jpeg files"):
        load_images(str(tmp_path))
    (tmp_path / "x.png").write_text("not a png")
    with pytest.raises(ValueError, match="cannot read .*x.png' as an image"):
        load_images(str(tmp_path / "x.png"))


def test_preprocess_shape_and_normalisation():
    images = load_images("skimage:chelsea")  # 300 x 451: center-cropped to a square
    batch = preprocess(images, 196)
    assert batch.shape == (1, 3, 196, 196) and batch.dtype == np.float32
    assert -2.2 < batch.min() < batch.max() < 2.7  # ImageNet-normalised [0, 1] pixels
