"""Activations: capture Q/K/V from vision transformers and decoder language models, read/write activation files,
synthetic generators.

Heavy optional dependencies (onnx, onnxruntime, scikit-image, Pillow, timm, transformers, gguf) are imported inside
the functions that need them, so ``import randattn.activations`` stays light.
"""

from randattn.activations.io import (
    Activations,
    NoGridWarning,
    infer_grid,
    load_activations,
    make_activations,
    save_activations,
)

__all__ = ["Activations", "NoGridWarning", "infer_grid", "load_activations", "make_activations", "save_activations"]
