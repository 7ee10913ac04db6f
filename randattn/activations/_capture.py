"""What every capture does around its model: one forward pass per image, then the images joined per layer."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

__all__ = ["run_per_image", "join_images", "hooked_layers_and_scale", "check_one_scale"]


def run_per_image(images: Sequence[Any], forward: Callable[[Any], dict], progress: Callable[[int, int], None] | None
                  ) -> list[dict]:
    """``forward(image)`` for each image in turn, calling ``progress(done, total)`` after each."""
    results = []
    for index, image in enumerate(images):
        results.append(forward(image))
        if progress is not None:
            progress(index + 1, len(images))
    return results


def join_images(per_image: Sequence[dict], layers: Sequence[int]) -> dict[int, tuple[np.ndarray, ...]]:
    """``{layer: (q, k, v)}`` with each image's ``(1, H, N, D)`` arrays concatenated along the image axis."""
    return {layer: tuple(np.concatenate([r[layer][role] for r in per_image]) for role in "qkv") for layer in layers}


def hooked_layers_and_scale(per_image: Sequence[dict]) -> tuple[list[int], float]:
    """The layers a hooked forward pass captured and the softmax scale they share.

    Raises
    ------
    ValueError
        The layers use different scales (one activation file holds one scale).
    """
    chosen = sorted(k for k in per_image[0] if k != "scale")
    scales = [per_image[0]["scale"][layer] for layer in chosen]
    check_one_scale(chosen, scales)
    return chosen, scales[0]


def check_one_scale(layers: Sequence[int], scales: Sequence[float]) -> None:
    """ValueError unless every layer in ``layers`` has the same scale, naming each layer's (one activation file holds
    one scale)."""
    if len(set(scales)) > 1:
        each = ", ".join(f"layer {layer}: {scale:.6g}" for layer, scale in zip(layers, scales))
        raise ValueError(f"layers {list(layers)} use different scales ({each}); capture them separately (one "
                         "activation file holds one scale)")
