"""Float32 matrix products at full precision while randattn computes, and the record of what ran where.

On Ampere and later GPUs torch may run float32 matrix products in TF32 (a 10-bit mantissa), and on CPUs
with oneDNN in bfloat16: either would put a rounding of ~1e-3 relative into every logit, far above the
float32 tolerances the measurements state (ARCHITECTURE sec. 3). :func:`full_precision_matmul` turns
both off for the duration of a computation and restores the caller's settings after, so a user's own
model code keeps its choice.

torch 2.9 and later have per-backend settings (``torch.backends.cuda.matmul.fp32_precision``, ...), and
mixing them with the legacy ``torch.set_float32_matmul_precision`` raises on a later read; the new ones
are used where they exist, the legacy ones otherwise.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

__all__ = ["full_precision_matmul", "compute_environment"]

#: the per-backend float32 settings randattn pins to IEEE float32 (torch >= 2.9)
_BACKENDS = ("cuda.matmul", "mkldnn.matmul")


def _backend(torch, path: str):
    owner = torch.backends
    for name in path.split("."):
        owner = getattr(owner, name, None)
        if owner is None:
            return None
    return owner if hasattr(owner, "fp32_precision") else None


@contextlib.contextmanager
def full_precision_matmul() -> Iterator[None]:
    """Run the block with float32 matrix products in IEEE float32 (no TF32, no bfloat16), then restore.

    Cheap (a few attribute reads and writes), safe to nest, and a no-op on a torch without the settings.
    """
    import torch

    backends = [b for b in (_backend(torch, path) for path in _BACKENDS) if b is not None]
    if backends:
        saved: list[Any] = [b.fp32_precision for b in backends]
        try:
            for b in backends:
                b.fp32_precision = "ieee"
            yield
        finally:
            for b, value in zip(backends, saved):
                b.fp32_precision = value
        return
    # before torch 2.9 one global setting; "highest" is TF32 off (``allow_tf32`` is the same flag)
    precision = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        yield
    finally:
        torch.set_float32_matmul_precision(precision)


def compute_environment(device: Any = None) -> dict[str, Any]:
    """What a table's numbers were computed with: torch version, device (and its GPU name), float32 matmul precision.

    ``device``: the run's torch device (None: CPU). The precision is the one
    :func:`full_precision_matmul` enforces while randattn computes.
    """
    import torch

    device = torch.device("cpu" if device is None else device)
    name = None
    if device.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(device)
    return {
        "torch": torch.__version__,
        "device": str(device),
        "device_name": name,
        "float32_matmul": "ieee (TF32 and bfloat16 reductions off while randattn computes)",
    }
