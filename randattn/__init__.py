"""randattn: softmax attention and its randomized estimators, twice (float64 reference and
batched torch), and measured against exact softmax."""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _installed_version  # not randattn.version: __version__ is the version

from randattn.api import draw, estimate
from randattn.estimators.base import BatchedForms, EstimatorSpec, ExactLimit, ImportanceWeights, Param
from randattn.estimators.registry import (
    catalogue,
    get_spec,
    list_estimators,
    register_estimator,
    unregister_estimator,
)

try:
    __version__ = _installed_version("randattn")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0+unknown"

__all__ = [
    "estimate",
    "draw",
    "catalogue",
    "get_spec",
    "list_estimators",
    "register_estimator",
    "unregister_estimator",
    "BatchedForms",
    "EstimatorSpec",
    "ExactLimit",
    "ImportanceWeights",
    "Param",
    "__version__",
]
