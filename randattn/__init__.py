"""randattn: softmax attention and its randomized estimators, twice (float64 reference and
batched torch), and measured against exact softmax."""

from importlib.metadata import PackageNotFoundError, version

from randattn.api import draw, estimate
from randattn.estimators.registry import catalogue, get_spec, list_estimators

try:
    __version__ = version("randattn")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0+unknown"

__all__ = ["estimate", "draw", "catalogue", "get_spec", "list_estimators", "__version__"]
