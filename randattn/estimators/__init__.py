"""The mathematics: every estimator of softmax attention, as a spec (the estimator protocol).

An estimator is an :class:`EstimatorSpec`: its name and parameters, ``draw`` (the random
variables), ``reference`` (numpy float64, the paper's equations) and its torch forms
(:class:`BatchedForms`: the batched estimate and the optional probability forms), and the
facts the rest of randattn needs, declared once. Built-in estimators and plugins register the same
way (:mod:`randattn.estimators.registry`) and are held to the same checks
(:func:`randattn.testing.check_estimator`).
"""

from randattn.estimators.base import (
    CONVERGENCE,
    COSTS,
    DECLARABLE_MASKS,
    MASKS,
    OPTIONAL_FORMS,
    PROMISE_QUANTITIES,
    RESERVED_PARAMETER_NAMES,
    SELECTIONS,
    BatchedForm,
    BatchedForms,
    Draws,
    EstimatorOptions,
    EstimatorSpec,
    ExactLimit,
    ImportanceWeights,
    Param,
    SpecError,
    UnknownParameterError,
    keyword_entry,
    option,
    validate_spec,
)

__all__ = [
    "CONVERGENCE",
    "COSTS",
    "DECLARABLE_MASKS",
    "MASKS",
    "OPTIONAL_FORMS",
    "PROMISE_QUANTITIES",
    "RESERVED_PARAMETER_NAMES",
    "SELECTIONS",
    "BatchedForm",
    "BatchedForms",
    "Draws",
    "EstimatorOptions",
    "EstimatorSpec",
    "ExactLimit",
    "ImportanceWeights",
    "Param",
    "SpecError",
    "UnknownParameterError",
    "keyword_entry",
    "option",
    "validate_spec",
]
