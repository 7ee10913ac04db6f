"""Input validation shared by every public function: one place, clear messages.

Errors name the argument, the value or shape received, and what is allowed. Nothing
here uses ``assert`` (it vanishes under ``python -O``).
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import numpy as np

__all__ = [
    "ParameterError",
    "check_choice",
    "check_positive_int",
    "check_qkv_shapes",
    "check_finite_on_device",
    "check_scale",
    "default_scale",
    "available_devices",
    "check_device",
]


class ParameterError(ValueError):
    """A parameter's value is refused: which parameter, its value as the message shows it, and what is wrong.

    The message names the parameter as a Python caller passes it (``device='cuda:3': ...``); a command line
    names its own option for it (:meth:`naming`).

    Attributes
    ----------
    parameter : str
        The parameter's name (``"device"``).
    shown : str or None
        Its value as the message shows it (``"'cuda:3'"``), or None where the message names the parameter only.
    problem : str
        The rest of the sentence: ``": only 1 CUDA device(s) are visible; ..."``, ``" must be a fraction ..."``.
    """

    def __init__(self, parameter: str, shown: str | None, problem: str) -> None:
        super().__init__(parameter, shown, problem)
        self.parameter, self.shown, self.problem = parameter, shown, problem

    def naming(self, subject: str, joiner: str = "=") -> str:
        """The message with the parameter called ``subject``, joined to its value by ``joiner``."""
        return f"{subject}{self.problem}" if self.shown is None else f"{subject}{joiner}{self.shown}{self.problem}"

    def __str__(self) -> str:
        return self.naming(self.parameter)


def check_choice(name: str, value: Any, allowed: Iterable[Any]) -> Any:
    """Return ``value`` if it is one of ``allowed``, else raise ``ValueError`` listing them."""
    allowed = tuple(allowed)
    if value not in allowed:
        listed = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"{name}={value!r} is not allowed; choose one of {listed}")
    return value


def check_positive_int(name: str, value: Any, *, minimum: int = 1) -> int:
    """Return ``value`` as an int if it is an integer >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def default_scale(head_dim: int) -> float:
    """The ViT temperature ``D ** -0.5``."""
    return float(head_dim) ** -0.5


def check_scale(scale: Any, head_dim: int) -> float:
    """Return the attention temperature: ``scale`` or ``D ** -0.5`` when it is None."""
    if scale is None:
        return default_scale(head_dim)
    if isinstance(scale, (str, bytes, bool)):  # float("0.1") would pass a text as a number
        raise TypeError(f"scale must be a positive real number, got {scale!r}")
    try:
        value = float(scale)
    except (TypeError, ValueError):
        raise TypeError(f"scale must be a positive real number, got {scale!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    return value


def _shape_dtype(name: str, array: Any, *, values: bool = True) -> tuple[tuple[int, ...], Any, bool]:
    """Shape, dtype and whether the values are all finite (True unread where ``values`` is False), for numpy arrays
    and torch tensors."""
    shape = getattr(array, "shape", None)
    dtype = getattr(array, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(
            f"{name} must be a numpy array or torch tensor of shape (..., tokens, features), "
            f"got {type(array).__name__}"
        )
    shape = tuple(int(s) for s in shape)
    if isinstance(array, np.ndarray):
        floating = np.issubdtype(array.dtype, np.floating)
    else:  # torch.Tensor
        floating = bool(getattr(array, "is_floating_point", lambda: False)())
    if not floating:
        raise TypeError(f"{name} must have a real floating dtype (float16/32/64), got {dtype}")
    if 0 in shape or not values:
        return shape, dtype, True
    # a broadcast input (stride 0, e.g. an identity expanded over heads) holds each value once: check that once
    strides = array.strides if isinstance(array, np.ndarray) else array.stride()
    if any(st == 0 for st in strides):
        array = array[tuple(slice(0, 1) if st == 0 else slice(None) for st in strides)]
    # the extremes are finite iff every value is (max/min propagate NaN): two reductions, no boolean array
    # the size of the input (the sweep's probability pass validates an (M, M) identity on every call)
    if isinstance(array, np.ndarray):
        finite = bool(np.isfinite(array.max()) and np.isfinite(array.min()))
    elif getattr(array.device, "type", "cpu") != "cpu":
        # on an accelerator reading the answer back would synchronise the device on every estimator call;
        # inputs are checked once where they enter instead (randattn.estimate, the sweep's activation loader)
        finite = True
    else:
        import torch

        finite = bool(torch.isfinite(array.amax()) and torch.isfinite(array.amin()))
    return shape, dtype, finite


def check_finite_on_device(**arrays: Any) -> None:
    """Raise ValueError naming the first of ``arrays`` (torch tensors on an accelerator) holding NaN or inf.

    :func:`check_qkv_shapes` does not read accelerator tensors back (a device sync per estimator call);
    the public entry points call this once instead.
    """
    for name, array in arrays.items():
        # numpy 2 arrays have a string ``device`` ("cpu"); torch's has a ``type``
        if getattr(getattr(array, "device", None), "type", "cpu") != "cpu" and array.numel():
            import torch

            if not bool(torch.isfinite(array).all()):
                raise ValueError(f"{name} contains NaN or infinite values")


def check_finite(**arrays: Any) -> None:
    """Raise ValueError naming the first of ``arrays`` (numpy arrays or torch tensors on the CPU) holding NaN or inf:
    the values check of :func:`check_qkv_shapes`, for a caller that reads only a block of its inputs."""
    for name, array in arrays.items():
        if not _shape_dtype(name, array)[2]:
            raise ValueError(f"{name} contains NaN or infinite values")


def check_qkv_shapes(q: Any, k: Any, v: Any, *, values: bool = True) -> tuple[tuple[int, ...], int, int, int, int]:
    """Validate queries, keys and values of one attention call.

    Parameters
    ----------
    q : (..., N, D) array or tensor
    k : (..., M, D) array or tensor
    v : (..., M, Dv) array or tensor
    values : bool
        Whether to read the values for NaN and inf (two reductions over each input). False checks types and shapes
        only, for a caller that reads a block of the inputs and checks that block (:func:`check_finite`): a
        tiled pass that checked whole inputs per tile would read them once per tile.

    Returns
    -------
    batch_shape, N, M, D, Dv
        The common leading (batch) shape and the sizes.

    Raises
    ------
    TypeError
        When an input is not a floating array.
    ValueError
        When shapes disagree, a sequence is empty, or a value is NaN or infinite.
    """
    shapes = {}
    for name, array in (("q", q), ("k", k), ("v", v)):
        shape, _, finite = _shape_dtype(name, array, values=values)
        if len(shape) < 2:
            raise ValueError(f"{name} must have shape (..., tokens, features), got shape {shape}")
        if shape[-1] == 0:
            raise ValueError(f"{name} has no features: shape {shape}")
        if shape[-2] == 0:
            raise ValueError(f"{name} is an empty sequence (0 tokens): shape {shape}")
        if not finite:
            raise ValueError(f"{name} contains NaN or infinite values")
        shapes[name] = shape
    qs, ks, vs = shapes["q"], shapes["k"], shapes["v"]
    if qs[-1] != ks[-1]:
        raise ValueError(f"q and k must have the same feature dim D: q {qs}, k {ks}")
    if ks[-2] != vs[-2]:
        raise ValueError(f"k and v must have the same number of tokens M: k {ks}, v {vs}")
    if not (qs[:-2] == ks[:-2] == vs[:-2]):
        hint = ""
        if (len(qs) >= 3 and len(qs) == len(ks) and ks[:-2] == vs[:-2] and qs[:-3] == ks[:-3] and ks[-3]
                and qs[-3] % ks[-3] == 0 and qs[-3] > ks[-3]):
            # a capture's stored key/value heads, which grouped-query attention shares among the query heads
            hint = (f"; {qs[-3]} query heads over {ks[-3]} key/value heads looks like grouped-query attention: give "
                    "each query head its key/value head (Activations.qkv(layer) does, through head_map)")
        raise ValueError(f"q, k and v must have the same batch dims: q {qs}, k {ks}, v {vs}{hint}")
    return qs[:-2], qs[-2], ks[-2], qs[-1], vs[-1]


def available_devices() -> list[str]:
    """torch devices usable here: ``cpu``, then ``cuda:i`` for every visible GPU, then ``mps`` if present."""
    import torch

    found = ["cpu"]
    if torch.cuda.is_available():
        found += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        found.append("mps")
    return found


def check_device(device: Any) -> Any:
    """Return ``torch.device(device)`` if it names a device usable here, else raise :class:`ParameterError`.

    The message names the device and lists those available (``torch.device("tpu")`` raises a
    RuntimeError, and a CUDA device on a CPU-only torch fails later with an AssertionError:
    neither says what to do).
    """
    import torch

    if device is None:
        return torch.device("cpu")
    try:
        dev = device if isinstance(device, torch.device) else torch.device(str(device))
    except (RuntimeError, TypeError):
        raise ParameterError("device", repr(device), f" is not a torch device; available here: "
                             f"{', '.join(available_devices())}") from None
    if dev.type == "cpu":
        return dev
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ParameterError("device", repr(str(device)), f": {why} (torch {torch.__version__}); available here: "
                                 f"{', '.join(available_devices())}")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ParameterError("device", repr(str(device)),
                                 f": only {torch.cuda.device_count()} CUDA device(s) are visible; "
                                 f"available here: {', '.join(available_devices())}")
        return dev
    if dev.type == "mps" and "mps" in available_devices():
        return dev
    raise ParameterError("device", repr(str(device)),
                         f" is not available here; available: {', '.join(available_devices())}")
