"""A test-only stand-in for torchvision, so that timm imports beside the CPU torch wheel here.

Why: every timm release imports torchvision at import time (FrozenBatchNorm2d, image
transforms, datasets), and PyPI's torchvision for torch 2.13.0 links CUDA libraries and
fails to load beside the CPU wheel ("operator torchvision::nms does not exist"). A ViT's
forward pass uses none of it: the stub only satisfies those imports, so the model code
exercised by the capture tests is timm's own. Used only when a real torchvision is absent.
"""

from __future__ import annotations

import enum
import importlib.machinery
import types

MODULES = (
    "torchvision",
    "torchvision.ops",
    "torchvision.ops.misc",
    "torchvision.transforms",
    "torchvision.transforms.functional",
    "torchvision.datasets",
    "torchvision.models",
    "torchvision.models.feature_extraction",
    "torchvision.utils",
)


class InterpolationMode(enum.Enum):
    """timm builds lookup tables from these members at import time."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class _AnyMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return Placeholder


class Placeholder(metaclass=_AnyMeta):
    """Any torchvision class or function timm names at import time; unusable on purpose."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError("torchvision is stubbed in this test; this feature is not available")


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return Placeholder


def stub_modules() -> dict[str, types.ModuleType]:
    """Fresh stub modules keyed by name, wired as packages and attributes of their parents."""
    modules: dict[str, types.ModuleType] = {}
    for name in MODULES:
        module = _StubModule(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        module.__path__ = []
        modules[name] = module
    for name in MODULES[1:]:
        parent, _, child = name.rpartition(".")
        setattr(modules[parent], child, modules[name])
    modules["torchvision.transforms"].InterpolationMode = InterpolationMode
    modules["torchvision.transforms.functional"].InterpolationMode = InterpolationMode
    return modules
