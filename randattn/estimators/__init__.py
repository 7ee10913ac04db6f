"""The mathematics: every estimator of softmax attention, as a spec (the estimator protocol).

An estimator is an :class:`EstimatorSpec`: its name and parameters, ``draw`` (the random
variables), ``reference`` (numpy float64, the paper's equations) and ``batched`` (torch), and the
facts the rest of randattn needs, declared once. Built-in estimators and plugins register the same
way (:mod:`randattn.estimators.registry`) and are held to the same checks
(:func:`randattn.testing.check_estimator`).
"""

from randattn.estimators.base import (
    CONVERGENCE,
    COSTS,
    MASKS,
    RESERVED_PARAMETER_NAMES,
    SELECTIONS,
    Draws,
    EstimatorSpec,
    ExactLimit,
    ImportanceWeights,
    Param,
    SpecError,
    validate_spec,
)

__all__ = [
    "CONVERGENCE",
    "COSTS",
    "MASKS",
    "RESERVED_PARAMETER_NAMES",
    "SELECTIONS",
    "Draws",
    "EstimatorSpec",
    "ExactLimit",
    "ImportanceWeights",
    "Param",
    "SpecError",
    "validate_spec",
]
