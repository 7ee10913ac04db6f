"""Random-feature maps of the softmax kernel ``exp(x·y)``, as log-features.

``reference`` (numpy float64) and ``batched`` (torch) hold the same maps with the same
layout: for inputs ``x : (..., N, D)`` and directions ``omega : (..., S, D)`` a map returns
``(log_magnitude, sign)`` with shape ``(..., N, S, L)`` (L features per direction), where
``sign`` is None for positive maps, so that ``phi = sign * exp(log_magnitude)`` and the
kernel estimate is ``(1/S) sum_{s,l} phi_sl(x) phi_sl(y)``.
"""

FEATURE_MAPS = ("positive", "hyperbolic", "trigonometric", "regularized", "oprf", "sderf")
#: maps whose features are all positive (an SNIS in log space is possible, LARA sec. 3.1)
POSITIVE_MAPS = ("positive", "hyperbolic", "regularized", "oprf", "sderf")
#: maps whose parameters are fitted from the inputs (every query and key: OPRF's A*, SDERF's (A, B)), so that one
#: token's features depend on all the others'; no causal form (a later token would move an earlier output)
DATA_DEPENDENT_MAPS = ("oprf", "sderf")
