"""Bookkeeping shared by every estimator: the draws container and the estimator spec.

Sampling is separate from estimation (ARCHITECTURE sec. 3): ``draw`` makes every random
variable an estimator uses, as float64 numpy arrays with a leading replicate dim, and
``estimate(q, k, v, draws, scale=..., **params)`` is a pure function of them. The
reference (numpy, float64) and batched (torch) forms consume the same ``Draws``; the torch
forms, the estimate and the optional ones, are declared together in one :class:`BatchedForms`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import keyword
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, Sequence, get_args

import numpy as np

from randattn._validation import check_choice
from randattn.estimators.masks import DECLARABLE_MASKS, MASKS, Mask

__all__ = [
    "CONVERGENCE",
    "COSTS",
    "DECLARABLE_MASKS",
    "MASKS",
    "RESERVED_PARAMETER_NAMES",
    "SELECTIONS",
    "QUERY_PLACEMENTS",
    "PROMISE_QUANTITIES",
    "OPTIONAL_FORMS",
    "BatchedForm",
    "BatchedForms",
    "Draws",
    "ExactLimit",
    "ImportanceWeights",
    "Param",
    "EstimatorOptions",
    "option",
    "keyword_entry",
    "family_spec",
    "deterministic_spec",
    "no_draws",
    "never_random",
    "EstimatorSpec",
    "SpecError",
    "UnknownParameterError",
    "validate_spec",
]

#: what an estimator claims of its error as S grows (:attr:`EstimatorSpec.convergence`):
#: ``exact`` equals softmax attention (to rounding) for every S and draw; ``unbiased``: the mean
#: over draws is softmax attention at every S; ``consistent``: the MSE falls like 1/S (bias
#: O(1/S), e.g. self-normalized importance sampling); ``none``: no claim (a biased approximation).
CONVERGENCE = ("exact", "unbiased", "consistent", "none")
#: how time and memory grow with the number of tokens (:attr:`EstimatorSpec.cost`): ``linear``
#: promises never to hold an N x M array; ``quadratic`` makes no such promise.
COSTS = ("linear", "quadratic")
# MASKS (None, "causal") and DECLARABLE_MASKS (those and "sliding"), the attention masks an estimator may support
# (:attr:`EstimatorSpec.masks`), are defined once in randattn.estimators.masks and re-exported here
# (ARCHITECTURE sec. 12).
#: how an estimator picks the keys it weighs (:attr:`EstimatorSpec.selection`): ``continuous``: every key's weight
#: is a continuous function of the inputs (or the keys are chosen by position or by the draws alone);
#: ``discrete``: keys are chosen by comparing values computed from the inputs (top-k scores, hash buckets), so
#: where two candidates nearly tie, float32 rounding may choose other keys than the float64 reference.
SELECTIONS = ("continuous", "discrete")
#: where an estimator places each query among the keys (:attr:`EstimatorSpec.query_placement`): ``independent``: the
#: estimate of query n depends on q_n, the keys, the values and the draws only (its position enters through the
#: mask alone); ``last-n-of-m``: query n is token n + M - N even without a mask (windows of recent keys); and
#: ``proportional``: without a mask N != M queries are spread over the keys in proportion (EVA's blocks and chunks).
QUERY_PLACEMENTS = ("independent", "last-n-of-m", "proportional")
#: what an estimator's (epsilon, delta) promise bounds (:attr:`EstimatorSpec.promise_on`): ``output``: the relative
#: output error :math:`\lVert \hat y_n - y_n \rVert / \lVert y_n \rVert`; ``denominator``: the relative error
#: :math:`|\hat Z_n - Z_n| / Z_n` of its estimate of the softmax normaliser
#: :math:`Z_n = \sum_{m \in V_n} e^{s\, q_n \cdot k_m}` (vAttention's budget rule, which sizes its sample for it)
PROMISE_QUANTITIES = ("output", "denominator")
#: names an estimator parameter may not take: the arguments of ``randattn.estimate`` and ``randattn.draw`` and
#: the names the protocol passes to ``draw``, ``reference`` and ``batched`` beside the parameters (a parameter
#: ``k`` would collide with the keys of ``estimate(name, q, k, v, ...)``).
RESERVED_PARAMETER_NAMES = ("name", "q", "k", "v", "q_shape", "k_shape", "draws", "num_samples", "seed",
                            "replicates", "rng", "scale", "mask", "backend", "dtype", "device", "preset")


#: the optional torch forms a spec may declare beside its batched estimate (:class:`BatchedForms`), by name
BatchedForm = Literal["probabilities", "estimate_with_probabilities", "estimate_with_float32_probabilities",
                      "estimate_with_probability_factors", "estimate_with_probabilities_and_keys_used",
                      "estimate_with_probabilities_keys_used_and_log_denominator"]
#: the names of :data:`BatchedForm`, in the order :class:`BatchedForms` declares them
OPTIONAL_FORMS: tuple[str, ...] = get_args(BatchedForm)


class SpecError(ValueError):
    """An estimator spec that does not satisfy the protocol; the message lists every problem."""


class UnknownParameterError(ValueError):
    """Options an estimator does not have, with what it has, and whether it takes S (``num_samples``): the facts a
    caller words its own way (:meth:`naming`; the command line names its own option for S, or none)."""

    def __init__(self, estimator: str, unknown: Sequence[str], allowed: Sequence[str], takes_samples: bool) -> None:
        self.estimator, self.unknown, self.allowed = estimator, tuple(unknown), tuple(allowed)
        self.takes_samples = takes_samples
        super().__init__(self.naming("num_samples", arrays=True))

    def naming(self, samples: str | None, *, arrays: bool = False) -> str:
        """The message, with ``samples`` the caller's name for S (None: no hint where S goes) and, with ``arrays``,
        a hint where an unknown option is named like an input array (a keyword meant as ``q``, ``k`` or ``v``, or
        top-k's ``k`` meant as its budget)."""
        budget = f"; S, its sample size or key budget, is {samples}" if self.takes_samples and samples else ""
        inputs = ("; q, k and v are the input arrays, given by position"
                  if arrays and {"q", "k", "v"} & set(self.unknown) else "")
        return (f"unknown parameter(s) {', '.join(map(repr, self.unknown))} for estimator {self.estimator!r}; "
                f"allowed: {', '.join(self.allowed)}{budget}{inputs}")


@dataclass(frozen=True)
class Draws:
    """The random variables of one estimator call.

    Attributes
    ----------
    arrays : mapping of str to array
        Each array has a leading replicate dim ``R`` followed by the batch dims of the
        inputs, e.g. ``omega : (R, ..., S, D)``. numpy float64 as drawn; torch tensors
        after :meth:`to_torch`.
    replicates : int
        ``R``, the number of independent replicates.
    """

    arrays: Mapping[str, Any]
    replicates: int

    def __getitem__(self, key: str) -> Any:
        try:
            return self.arrays[key]
        except KeyError:
            raise KeyError(
                f"draws have no {key!r}; they hold {sorted(self.arrays)} "
                "(were they made by another estimator's draw()?)"
            ) from None

    def __contains__(self, key: str) -> bool:
        return key in self.arrays

    def to_torch(self, device: Any = None, dtype: Any = None) -> "Draws":
        """The same draws as torch tensors on ``device`` (values are copied, not redrawn)."""
        import torch

        dtype = torch.float64 if dtype is None else dtype
        return Draws(
            {k: torch.as_tensor(np.asarray(a), dtype=dtype, device=device) for k, a in self.arrays.items()},
            self.replicates,
        )


@dataclass(frozen=True)
class Param:
    """One estimator parameter: its default, what is allowed, and what it means."""

    default: Any
    doc: str
    choices: tuple[Any, ...] | None = None
    kind: type | tuple[type, ...] | None = None

    def check(self, name: str, value: Any) -> Any:
        if self.choices is not None:
            return check_choice(name, value, self.choices)
        if self.kind is not None and not isinstance(value, self.kind) or isinstance(value, bool) and self.kind in (int, float):
            expected = self.kind.__name__ if isinstance(self.kind, type) else "/".join(t.__name__ for t in self.kind)
            raise TypeError(f"{name} must be {expected}, got {type(value).__name__} {value!r}")
        return value


def option(default: Any, doc: str, *, choices: tuple[Any, ...] | None = None,
           kind: type | tuple[type, ...] | None = None) -> Any:
    """A field of an :class:`EstimatorOptions` class that is an estimator parameter, its :class:`Param` declared once.

    The field's default is the parameter's default; :meth:`EstimatorOptions.params` collects the
    :class:`Param` of every such field (the spec's ``params``), and construction checks the value
    against it (:meth:`Param.check`).
    """
    return field(default=default, metadata={"param": Param(default, doc, choices=choices, kind=kind)})


def _python_scalar(value: Any, kind: type | tuple[type, ...] | None) -> int | float | bool | None:
    """``value`` as a Python ``int``/``float``/``bool`` where it is a numpy scalar of a kind ``kind`` allows, else None."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    for numpy_type, python_type in ((np.bool_, bool), (np.integer, int), (np.floating, float)):
        if isinstance(value, numpy_type) and python_type in kinds:
            return python_type(value)
    return None


@dataclass(frozen=True, kw_only=True)
class EstimatorOptions:
    """The keyword options of one estimator family, declared once and validated in one place.

    A family subclasses this (a frozen, keyword-only dataclass): each parameter is a field made
    with :func:`option` (default, meaning, choices or type), protocol keywords that are not
    parameters (``scale``; ``mask`` where the family supports one) are plain fields, and rules
    between parameters go in :meth:`check`. :meth:`params` gives the spec's ``params``, and
    :func:`keyword_entry` builds the public keyword entry points ``f(q, k, v, draws, *, scale,
    **params)`` from functions of ``(q, k, v, draws, options)``, as ``scipy.stats.qmc.QMCEngine.random``
    wraps each engine's ``_random``.

    Attributes
    ----------
    scale : float or None
        Temperature; None: ``D ** -0.5``. Checked against the inputs where they are prepared (it
        needs their dtype and D), not here.
    """

    scale: float | None = None

    def __post_init__(self) -> None:
        for name, param in self.params().items():
            # a numpy scalar (a setting read back from a table or an array) is the Python number it equals, as the
            # families' own checks always took it; the Param checks, like randattn.estimate's, want Python types
            python = _python_scalar(getattr(self, name), param.kind)
            if python is not None:
                object.__setattr__(self, name, python)
        # the family's rules first: they are the stricter, and their messages name the paper's terms
        self.check()
        for name, param in self.params().items():
            param.check(name, getattr(self, name))

    def check(self) -> None:
        """Rules between parameters (a family overrides it); raise ``ValueError``/``TypeError`` naming them."""

    @classmethod
    def params(cls) -> dict[str, Param]:
        """The estimator parameters, name -> :class:`Param`, in declaration order (the spec's ``params``)."""
        return {f.name: f.metadata["param"] for f in dataclasses.fields(cls) if "param" in f.metadata}

    def as_keywords(self, *, scale: bool = True) -> dict[str, Any]:
        """These options as an entry point's keywords (without ``scale`` when ``scale=False``)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if scale or f.name != "scale"}


def keyword_entry(options_type: type[EstimatorOptions], *,
                  leave_out: tuple[str, ...] = ()) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate ``impl(..., options)`` into the public keyword entry point ``f(..., *, scale, **params)``.

    The entry point's signature lists the arguments of ``impl`` before its last (``q, k, v, draws``, or ``q, k,
    draws``, or ``draw``'s ``q_shape, k_shape, *, num_samples, replicates, rng``) and, keyword-only, every field of
    ``options_type`` with its default but those in ``leave_out`` (``draw`` takes no ``scale``), so
    ``inspect.signature``, ``help()`` and a wrong keyword read as for a hand-written function; a call builds one
    ``options_type`` (which validates) and hands it to ``impl`` as its last argument. ``impl`` itself stays
    reachable as the entry point's ``on_options``, for callers that hold validated options already.

    Examples
    --------
    >>> @keyword_entry(LaraOptions)  # doctest: +SKIP
    ... def estimate(q, k, v, draws, options: LaraOptions) -> torch.Tensor:
    ...     "LARA over (R, ..., N, Dv)."
    >>> estimate(q, k, v, draws, proposal="eq33")  # doctest: +SKIP
    """
    keywords = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
        for f in dataclasses.fields(options_type) if f.name not in leave_out
    ]

    def decorate(impl: Callable[..., Any]) -> Callable[..., Any]:
        impl_signature = inspect.signature(impl)
        *protocol, options_parameter = impl_signature.parameters.values()
        signature = impl_signature.replace(parameters=[*protocol, *keywords])
        protocol_names = [p.name for p in protocol]

        @functools.wraps(impl)
        def entry(*args: Any, **kwargs: Any) -> Any:
            try:
                given = signature.bind(*args, **kwargs).arguments
            except TypeError as exc:
                raise TypeError(f"{entry.__qualname__}(): {exc}") from None
            options = options_type(**{name: value for name, value in given.items() if name not in protocol_names})
            # by name: draw's protocol arguments are keyword-only; those not given keep impl's defaults
            arguments = {name: given[name] for name in protocol_names if name in given}
            return impl(**arguments, **{options_parameter.name: options})

        del entry.__wrapped__  # inspect.signature must give the keyword signature, not impl's
        entry.__signature__ = signature
        entry.on_options = impl
        return entry

    return decorate


@dataclass(frozen=True)
class ImportanceWeights:
    """How to get an estimator's self-normalized importance weights, for the IS diagnostics.

    Kish's effective sample size, the delta-method variance and Pareto k-hat
    (:mod:`randattn.analysis.diagnostics`) are defined for an estimator of the form
    ``sum_j w_nj f_j / sum_j w_nj`` with positive weights (ARCHITECTURE sec. 4).

    Attributes
    ----------
    reference : callable
        numpy float64 ``(q, k, v, draws, *, scale, params) -> (log_w, f) | None`` with
        ``log_w : (R, ..., N, J)`` the unnormalized log weights and ``f : (R, ..., J, Dv)`` the
        per-sample values; None when the weights of this draw are not all positive.
    batched : callable
        torch form of ``reference`` with the same layout; a (replicate, batch element) whose
        weights are not all positive gets NaN log weights.
    reference_per_element : callable or None
        numpy form with ``batched``'s NaN convention (the sweep's reference backend); None:
        ``reference`` already has it.
    applies : callable
        ``applies(params) -> bool``: whether the configuration has positive weights at all
        (e.g. False for signed trigonometric features).
    weights_per_sample : callable
        ``weights_per_sample(params) -> int``: importance weights per sample (J = S L; 2 for
        hyperbolic features), which decides whether k-hat's tail of 5 can be fitted.
    masks : tuple or callable
        The masks of :data:`~randattn.estimators.masks.DECLARABLE_MASKS` the providers compute the weights
        under, or ``masks(params) -> tuple``; they get a ``mask=`` keyword only when it is not None, as the
        estimator's forms do.
        Default ``(None,)``: bidirectional weights only, so under a mask the diagnostics are skipped
        (weights that pool later keys would describe another estimator than the one measured).
    """

    reference: Callable[..., Any]
    batched: Callable[..., Any]
    reference_per_element: Callable[..., Any] | None = None
    applies: Callable[[Mapping[str, Any]], bool] = field(default=lambda params: True)
    weights_per_sample: Callable[[Mapping[str, Any]], int] = field(default=lambda params: 1)
    masks: tuple[str | None, ...] | Callable[[Mapping[str, Any]], tuple[str | None, ...]] = (None,)

    def masks_of(self, params: Mapping[str, Any]) -> tuple[str | None, ...]:
        """The masks the providers compute the weights under for the configuration ``params``."""
        return tuple(_fact(self.masks, params))


@dataclass(frozen=True)
class ExactLimit:
    """A configuration in which an estimator equals exact softmax attention (to rounding).

    Attributes
    ----------
    description : str
        What the limit is, with its source (e.g. ``"the local window covers every key (EVA sec. 4)"``).
    params : mapping or callable
        The parameters of the limit, or ``params(n, m) -> mapping`` for N queries and M keys.
    num_samples : int or callable or None
        S in the limit, or ``num_samples(n, m) -> int``; None: any S (the check uses 3).
    rtol : float
        Relative tolerance of the equality; 1e-10 unless the limit is only reached to a stated
        accuracy (say why where you declare it).
    """

    description: str
    params: Mapping[str, Any] | Callable[[int, int], Mapping[str, Any]] = field(default_factory=dict)
    num_samples: int | Callable[[int, int], int] | None = None
    rtol: float = 1e-10

    def resolve(self, n: int, m: int) -> tuple[dict[str, Any], int | None]:
        """The limit's parameters and S for N = ``n`` queries and M = ``m`` keys."""
        params = self.params(n, m) if callable(self.params) else self.params
        samples = self.num_samples(n, m) if callable(self.num_samples) else self.num_samples
        return dict(params), samples


def _fact(value: Any, params: Mapping[str, Any]) -> Any:
    """A declared fact: a constant, or a function of the resolved parameters."""
    return value(params) if callable(value) else value


def _denominator_promised(spec: "EstimatorSpec", params: Mapping[str, Any]) -> bool:
    """Whether ``params``' promise is on the denominator; False where ``promise_on`` raises (reported elsewhere)."""
    try:
        return spec.promise_on_of(params) == "denominator"
    except Exception:
        return False


@dataclass(frozen=True)
class BatchedForms:
    """An estimator's torch forms: the batched estimate and the optional forms it declares.

    The analysis and the conformance kit ask for an optional form by name (:meth:`has`,
    :meth:`get`), never by testing an attribute for None: a form is declared by giving it here,
    and one given is callable (checked on construction). Every form takes the draws of the
    spec's ``draw`` and ``mask=`` only when the mask is not None, as ``estimate`` does.

    Attributes
    ----------
    estimate : callable
        torch ``estimate(q, k, v, draws, *, scale, **params) -> (R, ..., N, Dv)``: the form of the
        spec's ``reference`` with the same signature and layout (:attr:`EstimatorSpec.batched`).
    probabilities : callable or None
        ``probabilities(q, k, draws, *, scale, **params) -> (R, ..., N, M)``: the attention
        probabilities the estimator implies, equal (to rounding) to ``estimate`` with ``v = I_M`` but
        without the ``(., M) x (M, M)`` products the identity would cost. Undeclared: the sweep calls
        ``estimate`` with ``v = I_M``.
    estimate_with_probabilities : callable or None
        ``(q, k, v, draws, *, scale, **params) -> (out, probs)``: ``estimate(q, k, v, ...)`` and
        ``probabilities(q, k, ...)``, the same bits, from one pass that computes their common terms
        (the draws' features, the weights) once. Undeclared: the sweep calls the two separately.
    estimate_with_float32_probabilities : callable or None
        ``(q, k, v, draws, *, scale, **params) -> (out, probs, bound) | None`` for float64 runs:
        ``out`` as ``estimate``, the probabilities from a float32 product, and ``bound (R, ..., N)``
        on each row's distance from the full-precision probabilities in the 2-norm. The sweep uses
        it when the bound shows the rounding negligible against the squared error it measures, and
        ``estimate_with_probabilities`` otherwise; a None result: no float32 product for this
        configuration. Undeclared: probabilities in the run's dtype.
    estimate_with_probability_factors : callable or None
        ``(q, k, v, draws, *, scale, **params) -> (out, left, right) | None``: ``out`` as
        ``estimate`` (the same bits) and the implied probabilities' factors, ``probabilities = left @
        right`` with ``left (R, ..., N, J)`` and ``right (R, ..., J, M)`` with entries in [0, 1]; a
        None result where a configuration has no such factors. The sweep measures the probability
        error from them without forming the ``(N, M)`` matrix
        (:mod:`randattn.analysis.probability_error`).
    estimate_with_probabilities_and_keys_used : callable or None
        ``(q, k, v, draws, *, scale, **params) -> (out, probs, counts)``: ``estimate_with_probabilities``' two
        results and the spec's ``keys_used`` counts ``(R, ..., N)`` float64, the same bits, from one selection.
        The sweep takes it where it measures both (an estimator that picks keys by hashing, as MagicPIG does,
        would otherwise hash every key twice). Undeclared: the sweep calls ``keys_used`` after the estimate.
    estimate_with_probabilities_keys_used_and_log_denominator : callable or None
        ``(q, k, v, draws, *, scale, **params) -> (out, probs, counts, log_denominator)``:
        ``estimate_with_probabilities_and_keys_used``' three results and the spec's ``log_denominator`` ``(R, ..., N)``
        float64, the same bits, from one selection. The sweep takes it where a promise on the denominator is
        checked (vAttention's selection would otherwise be made twice). Undeclared: the sweep calls
        ``log_denominator`` after the estimate.

    Examples
    --------
    >>> forms = BatchedForms(estimate=batched.estimate, probabilities=batched.probabilities)  # doctest: +SKIP
    >>> forms.has("probabilities"), forms.has("estimate_with_probability_factors")  # doctest: +SKIP
    (True, False)
    >>> probs = forms.get("probabilities")(q, k, draws, scale=None)  # doctest: +SKIP
    """

    estimate: Callable[..., Any]
    probabilities: Callable[..., Any] | None = None
    estimate_with_probabilities: Callable[..., Any] | None = None
    estimate_with_float32_probabilities: Callable[..., Any] | None = None
    estimate_with_probability_factors: Callable[..., Any] | None = None
    estimate_with_probabilities_and_keys_used: Callable[..., Any] | None = None
    estimate_with_probabilities_keys_used_and_log_denominator: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        if not callable(self.estimate):
            raise TypeError(f"BatchedForms: estimate must be callable, got {type(self.estimate).__name__}")
        for form in OPTIONAL_FORMS:
            value = getattr(self, form)
            if value is not None and not callable(value):
                raise TypeError(f"BatchedForms: {form} must be callable (declared) or None (not declared), "
                                f"got {type(value).__name__}")

    @property
    def declared(self) -> tuple[str, ...]:
        """The optional forms declared, in the order of :data:`OPTIONAL_FORMS`."""
        return tuple(form for form in OPTIONAL_FORMS if getattr(self, form) is not None)

    def has(self, form: BatchedForm) -> bool:
        """Whether the optional ``form`` (one of :data:`OPTIONAL_FORMS`) is declared.

        Raises
        ------
        ValueError
            ``form`` is not one of :data:`OPTIONAL_FORMS` (it lists them).
        """
        return check_choice("form", form, OPTIONAL_FORMS) in self.declared

    def get(self, form: BatchedForm) -> Callable[..., Any]:
        """The optional ``form`` (one of :data:`OPTIONAL_FORMS`); ask :meth:`has` first.

        Raises
        ------
        ValueError
            ``form`` is not one of :data:`OPTIONAL_FORMS`.
        LookupError
            ``form`` is not declared (the message lists the declared ones).
        """
        if not self.has(form):
            declared = ", ".join(self.declared) or "none"
            raise LookupError(f"the batched form {form!r} is not declared (declared: {declared})")
        return getattr(self, form)

    @classmethod
    def of(cls, module: Any) -> "BatchedForms":
        """The forms a module of torch forms defines under their protocol names.

        ``module.estimate``, and each of :data:`OPTIONAL_FORMS` the module has: a family's
        ``batched`` module declares a form by defining it under that name.
        """
        return cls(estimate=module.estimate,
                   **{form: getattr(module, form) for form in OPTIONAL_FORMS if hasattr(module, form)})

    def replace(self, **changes: Any) -> "BatchedForms":
        """These forms with ``changes`` (``estimate=`` or an optional form, None to withdraw it)."""
        return dataclasses.replace(self, **changes)


#: the keywords of earlier versions that gave the torch forms one by one, and the form each is now in BatchedForms
_LEGACY_FORM_KEYWORDS = {
    "batched": "estimate",
    "batched_probabilities": "probabilities",
    "batched_with_probabilities": "estimate_with_probabilities",
    "batched_with_float32_probabilities": "estimate_with_float32_probabilities",
    "batched_with_probability_factors": "estimate_with_probability_factors",
}


def _forms_with_legacy(forms: Any, legacy: Mapping[str, Any], stacklevel: int) -> BatchedForms:
    """``forms`` (or new forms, where None) with the forms given by the keywords of earlier versions, warning."""
    renamed = {_LEGACY_FORM_KEYWORDS[old]: value for old, value in legacy.items()}
    given = ", ".join(f"{old}=" for old in legacy)
    wanted = ", ".join(f"{new}=..." for new in renamed)
    warnings.warn(f"EstimatorSpec({given}) is deprecated; declare the batched forms in one object, "
                  f"EstimatorSpec(..., forms=BatchedForms({wanted}))", DeprecationWarning, stacklevel=stacklevel)
    if callable(forms) and not isinstance(forms, BatchedForms):  # ``batched`` by position, the rest by keyword
        renamed = {"estimate": forms, **renamed}
        forms = None
    return BatchedForms(**renamed) if forms is None else forms.replace(**renamed)


def _deprecated_form_property(old: str, form: str) -> property:
    def read(self: Any) -> Callable[..., Any] | None:
        warnings.warn(f"EstimatorSpec.{old} is deprecated; ask spec.forms.has({form!r}) and "
                      f"spec.forms.get({form!r})", DeprecationWarning, stacklevel=2)
        return getattr(self.forms, form)

    read.__name__ = old
    return property(read, doc=f"Deprecated: ``forms.{form}`` (None where not declared); ask ``forms.has({form!r})``.")


def _accepting_legacy_form_keywords(cls: type) -> type:
    """The spec class, taking the keywords of :data:`_LEGACY_FORM_KEYWORDS` too (deprecated), and reading the old
    optional fields as deprecated properties: specs written to the earlier protocol, and
    ``dataclasses.replace(spec, batched_probabilities=...)``, still work."""
    init = cls.__init__
    forms_position = [f.name for f in dataclasses.fields(cls)].index("forms")

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        legacy = {old: kwargs.pop(old) for old in _LEGACY_FORM_KEYWORDS if old in kwargs}
        if legacy:
            if len(args) > forms_position:
                args = (*args[:forms_position], _forms_with_legacy(args[forms_position], legacy, stacklevel=3),
                        *args[forms_position + 1:])
            else:
                kwargs["forms"] = _forms_with_legacy(kwargs.get("forms"), legacy, stacklevel=3)
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    for old, form in _LEGACY_FORM_KEYWORDS.items():
        if old != "batched":  # the batched estimate stays a plain property, EstimatorSpec.batched
            setattr(cls, old, _deprecated_form_property(old, form))
    return cls


@_accepting_legacy_form_keywords
@dataclass(frozen=True)
class EstimatorSpec:
    r"""What the registry knows of an estimator.

    Attributes
    ----------
    name : str
        Registry name (``"rfa"``, ``"ra"``, ...).
    summary : str
        One line: what it estimates and how.
    source : str
        Paper and equations it implements.
    complexity : str
        Time complexity in N (queries), M (keys), S (samples), D, Dv.
    params : mapping of str to Param
        Estimator options with the papers' defaults.
    draw : callable
        ``draw(q_shape, k_shape, *, num_samples, replicates, rng, **params) -> Draws``.
    reference : callable
        numpy float64 ``estimate(q, k, v, draws, *, scale, **params) -> (R, ..., N, Dv)``.
    forms : BatchedForms
        The torch forms: ``forms.estimate``, the form of ``reference`` with the same signature and
        layout (also :attr:`batched`), and the optional probability forms it declares, asked for by
        name (``forms.has("probabilities")``). The keywords ``batched=``, ``batched_probabilities=``,
        ``batched_with_probabilities=``, ``batched_with_float32_probabilities=`` and
        ``batched_with_probability_factors=`` of earlier versions still build it, with a
        DeprecationWarning.
    needs_samples : bool or callable
        Whether ``num_samples`` is required, or ``needs_samples(params) -> bool`` where a configuration sets its own
        sample size (vAttention's adaptive budget): such a configuration is drawn with ``num_samples=None`` and swept
        once, not once per S (:meth:`needs_samples_of`).
    is_random : callable
        ``is_random(params) -> bool``: False for deterministic variants (softmax, ``sample="mean"``).
    variants : mapping of str to params
        Parameter sets the common test suite runs (batched == reference, shapes, seeds).
    presets : mapping of str to params
        Named parameter sets selected by the ``preset`` parameter (e.g. ``"official-code"``: the
        conventions of the authors' code); ``"paper"`` (the defaults) is always allowed. Explicit
        parameters override the preset's (see :meth:`resolve_params`).
    display_name : str
        The family's readable name (``"Performer"``); default: ``name``.
    describe : callable or None
        ``describe(params, defaults) -> (head, parts, known)``: the readable description of a
        configuration (``head`` and extra ``parts`` go in parentheses after ``display_name``;
        ``known`` names the parameters it covered, the others are appended as ``key=value``).
        None: every non-default parameter as ``key=value``.
    convergence : str or callable
        One of :data:`CONVERGENCE`, or ``convergence(params) -> str``. ``randattn.testing``
        holds the estimator to it.
    cost : str or callable
        One of :data:`COSTS`, or ``cost(params) -> str``: ``linear`` is checked (no N x M
        tensor in the batched form).
    signed_weights : bool or callable
        Whether the configuration's weights can be negative, so that its sums cancel (the
        sweep then computes in float64 under ``--dtype auto``, and the IS diagnostics do not
        apply). ``signed_weights(params) -> bool`` for a fact that depends on the parameters.
    importance_weights : ImportanceWeights or None
        How to get the self-normalized importance weights for the IS diagnostics; None: the
        diagnostics do not apply to this estimator.
    masks : tuple or callable
        The masks of :data:`~randattn.estimators.masks.DECLARABLE_MASKS` it supports, or ``masks(params) ->
        tuple`` where a parameter decides (EVA: causal with the paper's disjoint partition on a 1-D layout only);
        ``"sliding"`` declares every sliding window, received as ``mask="sliding:W"``. ``draw``, ``reference``
        and ``batched`` get a ``mask=`` keyword only when it is not None.
    selection : str or callable
        One of :data:`SELECTIONS`, or ``selection(params) -> str``: ``discrete`` where keys are chosen by
        comparing values computed from the inputs (top-k, hashing), so that near ties may select other keys in
        float32; the float32 checks then compare such rows like with like (:mod:`randattn.testing.checks`).
    mask_notes : mapping of str to str or callable
        Why a mask is not supported (``{"causal": "its proposals pool every key"}``), or
        ``note(params) -> str`` where the reason depends on the configuration, for the error a
        user gets when asking for it.
    normalized : bool
        Whether its attention weights over the keys sum to one, so that with a single key it
        returns that key's value exactly (checked).
    exact_limits : tuple of ExactLimit
        Configurations in which it equals softmax attention (checked).
    query_placement : str or callable
        One of :data:`QUERY_PLACEMENTS`, or ``query_placement(params) -> str``: whether the estimate of a query
        depends on where it sits among the keys beyond what the mask says; ``mse --queries`` refuses a subset of
        query rows that would move them (a sample for ``last-n-of-m``; any subset without a mask for
        ``proportional``).
    keys_used : callable or None
        torch ``keys_used(q, k, draws, *, scale, **params) -> (R, ..., N)``: how many distinct keys each query's
        estimate reads, exact and sampled together (the budget axis of the decode-time sparse and sampling
        estimators, ARCHITECTURE sec. 14); a float64 tensor of counts, random where the selection is. ``mask=``
        is passed as to ``batched``. None: not declared (the sweep leaves the ``keys_used`` column empty).
    promise : callable or None
        ``promise(params) -> (epsilon, delta) | None``: the accuracy the configuration guarantees, as
        ``P(e_n > epsilon) <= delta`` for each query n, ``e_n`` the relative error of what :attr:`promise_on`
        names (vAttention's "verified" attention); the sweep then measures the violation rate of that quantity
        against it. None, or a None result: no promise.
    promise_on : str or callable
        One of :data:`PROMISE_QUANTITIES`, or ``promise_on(params) -> str``: what the promise bounds. ``output``
        (the default): the relative output error; ``denominator``: the relative error of the estimate of the
        softmax normaliser, which the spec then gives as :attr:`log_denominator`.
    log_denominator : callable or None
        torch ``log_denominator(q, k, draws, *, scale, **params) -> (R, ..., N)``: the log of the estimator's
        estimate :math:`\hat Z_n` of the softmax normaliser :math:`Z_n = \sum_{m \in V_n} e^{s\, q_n \cdot k_m}`
        over the keys each query sees (not max-shifted: a log, so that norms above 100 stay finite), a float64
        tensor, from the same draws as its estimate. ``mask=`` is passed as to ``batched``. Required where the
        promise is on the denominator.
    memory_hint : str
        What dominates its working memory, for the catalogue (the sweep measures the actual
        bytes of a cell before it plans, :mod:`randattn.analysis.memory`).
    stacked_draw : bool
        Whether ``draw`` may be given a grid of generators (:class:`~randattn.analysis.plan.StackedGenerators`)
        for its ``rng``: it asks the ``rng`` only for ``standard_normal``, ``random`` and ``chisquare``, each of a
        ``size`` that starts with ``(replicates, *batch dims)``, so that one call over a block of cells and
        replicates gives, bit for bit, the per-cell, per-replicate draws stacked (the kit checks this where it is
        declared). False (the default): the sweep calls ``draw`` once per cell and replicate with that replicate's
        numpy ``Generator``, and stacks the draws; the numbers are the same either way. :func:`family_spec`, which
        the built-in families are written with, declares it.
    """

    name: str
    summary: str
    source: str
    complexity: str
    params: Mapping[str, Param]
    draw: Callable[..., Draws]
    reference: Callable[..., Any]
    forms: BatchedForms
    needs_samples: bool | Callable[[Mapping[str, Any]], bool] = True
    is_random: Callable[[Mapping[str, Any]], bool] = field(default=lambda params: True)
    variants: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    presets: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    display_name: str = ""
    describe: Callable[..., tuple[str, list[str], set[str]]] | None = None
    convergence: str | Callable[[Mapping[str, Any]], str] = "none"
    cost: str | Callable[[Mapping[str, Any]], str] = "quadratic"
    signed_weights: bool | Callable[[Mapping[str, Any]], bool] = False
    importance_weights: ImportanceWeights | None = None
    masks: tuple[str | None, ...] | Callable[[Mapping[str, Any]], tuple[str | None, ...]] = (None,)
    mask_notes: Mapping[str, str | Callable[[Mapping[str, Any]], str]] = field(default_factory=dict)
    selection: str | Callable[[Mapping[str, Any]], str] = "continuous"
    normalized: bool = False
    exact_limits: tuple[ExactLimit, ...] = ()
    query_placement: str | Callable[[Mapping[str, Any]], str] = "independent"
    keys_used: Callable[..., Any] | None = None
    promise: Callable[[Mapping[str, Any]], tuple[float, float] | None] | None = None
    promise_on: str | Callable[[Mapping[str, Any]], str] = "output"
    log_denominator: Callable[..., Any] | None = None
    memory_hint: str = ""
    stacked_draw: bool = False

    def __post_init__(self) -> None:
        if callable(self.forms) and not isinstance(self.forms, BatchedForms):  # ``batched`` given by position
            object.__setattr__(self, "forms", _forms_with_legacy(None, {"batched": self.forms}, stacklevel=5))

    @property
    def batched(self) -> Callable[..., Any]:
        """The batched torch estimate, ``forms.estimate``: the form of ``reference`` with its signature and layout."""
        return self.forms.estimate

    # -- declared facts of one configuration (``params`` resolved) -----------------------------------------------------
    @property
    def family_name(self) -> str:
        """The readable family name: :attr:`display_name`, else the registry name."""
        return self.display_name or self.name

    def convergence_of(self, params: Mapping[str, Any]) -> str:
        """One of :data:`CONVERGENCE` for this configuration."""
        return _fact(self.convergence, params)

    def cost_of(self, params: Mapping[str, Any]) -> str:
        """One of :data:`COSTS` for this configuration."""
        return _fact(self.cost, params)

    def query_placement_of(self, params: Mapping[str, Any]) -> str:
        """One of :data:`QUERY_PLACEMENTS` for this configuration."""
        return _fact(self.query_placement, params)

    def selection_of(self, params: Mapping[str, Any]) -> str:
        """One of :data:`SELECTIONS` for this configuration."""
        return _fact(self.selection, params)

    def has_signed_weights(self, params: Mapping[str, Any]) -> bool:
        """Whether this configuration's weights can be negative."""
        return bool(_fact(self.signed_weights, params))

    def diagnostics_apply(self, params: Mapping[str, Any]) -> bool:
        """Whether the IS diagnostics (ESS, delta method, k-hat) can be defined for this configuration.

        Signed weights may still be all positive in a given draw; the providers report the draws
        where they are not (None or NaN), so the answer here is only "has importance weights".
        """
        weights = self.importance_weights
        return weights is not None and bool(weights.applies(params))

    def weights_per_sample(self, params: Mapping[str, Any]) -> int:
        """Importance weights per sample (J = S L), 1 when the diagnostics do not apply."""
        return int(self.importance_weights.weights_per_sample(params)) if self.importance_weights else 1

    def promise_of(self, params: Mapping[str, Any]) -> tuple[float, float] | None:
        """``(epsilon, delta)`` this configuration promises (see :attr:`promise`), or None."""
        if self.promise is None:
            return None
        promised = self.promise(params)
        return None if promised is None else (float(promised[0]), float(promised[1]))

    def promise_on_of(self, params: Mapping[str, Any]) -> str:
        """One of :data:`PROMISE_QUANTITIES`: what this configuration's promise bounds (see :attr:`promise_on`)."""
        return _fact(self.promise_on, params)

    def needs_samples_of(self, params: Mapping[str, Any] | None = None) -> bool:
        """Whether this configuration takes ``num_samples`` (the defaults', for ``params=None``)."""
        if not callable(self.needs_samples):
            return bool(self.needs_samples)
        return bool(self.needs_samples(self.resolve_params(dict(params or {}))))

    def masks_of(self, params: Mapping[str, Any] | None = None) -> tuple[str | None, ...]:
        """The masks this configuration supports (the estimator's, for ``params=None``: any configuration's)."""
        if not callable(self.masks):
            return tuple(self.masks)
        return tuple(self.masks(self.resolve_params({}) if params is None else params))

    def supports_mask(self, mask: str | None, params: Mapping[str, Any] | None = None) -> bool:
        """Whether ``mask`` (None, ``"causal"`` or ``"sliding:W"``) is one this estimator (or configuration
        ``params``) computes: its :attr:`~randattn.estimators.masks.Mask.declared` form is in :attr:`masks`."""
        form = _declared_form(mask)
        return (mask is None or form is not None) and form in self.masks_of(params)

    def check_mask(self, mask: str | None, params: Mapping[str, Any] | None = None) -> None:
        """Raise ValueError naming the estimator and what it supports when ``mask`` is not supported."""
        if mask is not None and _declared_form(mask) is None:
            raise ValueError(f"unknown mask {mask!r}; allowed: None (bidirectional), 'causal' or 'sliding:W' (W a "
                             "positive integer)")
        if not self.supports_mask(mask, params):
            supported = ", ".join("none" if m is None else repr(m) for m in self.masks_of(params))
            why = self.mask_notes.get(_declared_form(mask))
            if callable(why):
                why = why(self.resolve_params({}) if params is None else params)
            raise ValueError(f"estimator {self.name!r} does not support mask={mask!r} (it supports: {supported})"
                             + (f": {why}" if why else ""))

    def preset_names(self) -> tuple[str, ...]:
        """Allowed values of ``preset``: ``"paper"`` (the defaults) and the declared presets."""
        return ("paper", *(name for name in self.presets if name != "paper"))

    def expand_preset(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """``params`` with ``preset`` replaced by the parameters it stands for; explicit ones win.

        Raises ValueError naming the preset and the allowed ones when it is unknown.
        """
        params = dict(params)
        preset = params.pop("preset", "paper")
        if not isinstance(preset, str) or preset not in self.preset_names():
            raise ValueError(
                f"unknown preset {preset!r} for estimator {self.name!r}; allowed: {', '.join(self.preset_names())}"
            )
        return {**self.presets.get(preset, {}), **params}

    def resolve_params(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """Fill in defaults; reject unknown names and disallowed values with a clear error.

        A ``preset`` entry is expanded first (:meth:`expand_preset`); the result holds the
        expanded parameters only, never ``preset`` itself, so estimators need not know of it.
        """
        params = self.expand_preset(params)
        unknown = sorted(set(params) - set(self.params))
        if unknown:
            raise UnknownParameterError(self.name, unknown, [*sorted(self.params), "preset"],
                                        self.needs_samples is not False)
        resolved = {}
        for name, param in self.params.items():
            value = params.get(name, param.default)
            resolved[name] = param.check(name, value)
        return resolved


def family_spec(options: type[EstimatorOptions], draw: Callable[..., Draws], reference: Any, batched: Any,
                **facts: Any) -> EstimatorSpec:
    """The spec of a family written on ``options``: the protocol wiring said once, the family's facts given.

    ``params`` are ``options.params()``, ``reference`` is the reference module's ``estimate`` and ``forms`` the
    forms the torch module defines under their protocol names (:meth:`BatchedForms.of`); ``facts`` are every
    other :class:`EstimatorSpec` field (name, summary, source, complexity, variants, ...). ``stacked_draw`` is
    True unless ``facts`` say otherwise: the families' draws ask their ``rng`` for arrays of the stacked methods
    alone, leading with ``(replicates, *batch dims)``.
    """
    return EstimatorSpec(params=options.params(), draw=draw, reference=reference.estimate,
                         forms=BatchedForms.of(batched), **{"stacked_draw": True, **facts})


def never_random(params: Mapping[str, Any]) -> bool:
    """``is_random`` of a family none of whose configurations is random (its output is a function of the inputs)."""
    return False


def no_draws(options: type[EstimatorOptions]) -> Callable[..., Draws]:
    """The ``draw`` of a family with no random variables, on ``options``: ``Draws({}, replicates)``.

    ``draw(q_shape, k_shape, *, num_samples=None, replicates=1, rng=None, **params)`` takes the fields of
    ``options`` but ``scale`` as keywords (:func:`keyword_entry`), so a bad configuration is refused at the
    draw as at the estimate; ``num_samples``, ``rng`` and the mask change nothing.
    """
    @keyword_entry(options, leave_out=("scale",))
    def draw(q_shape: Sequence[int], k_shape: Sequence[int], *, num_samples: int | None = None, replicates: int = 1,
             rng: Any = None, options: EstimatorOptions) -> Draws:
        return Draws({}, replicates)

    draw.__doc__ = ("Deterministic: no random variables, only the replicate count (``num_samples``, ``rng`` and "
                    f"``mask`` change nothing; the parameters are checked by ``{options.__name__}``).")
    return draw


def deterministic_spec(options: type[EstimatorOptions], reference: Any, batched: Any, **facts: Any) -> EstimatorSpec:
    """The spec of a family that draws nothing and reads no S (softmax, local attention): :func:`family_spec`
    with ``draw = no_draws(options)``, ``needs_samples=False`` and ``is_random`` :func:`never_random`, stated
    here once; ``facts`` are the family's own."""
    return family_spec(options, no_draws(options), reference, batched, needs_samples=False, is_random=never_random,
                       **facts)


_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyz0123456789_-")


def _declared_form(mask: Any) -> str | None:
    """The entry of :data:`~randattn.estimators.masks.DECLARABLE_MASKS` that covers ``mask`` (None, ``"causal"``,
    ``"sliding:W"``); None for no mask and for a value that names no mask."""
    try:
        return Mask.parse(mask).declared if mask is None or isinstance(mask, str) else None
    except ValueError:
        return None


def _yes_or_no(fact: str, declared: Any, params: Mapping[str, Any], label: str, problems: list[str]) -> bool | None:
    """A declared yes/no fact (a bool, or a function of the parameters returning one) for ``params``; None, with
    the problem added to ``problems``, where it raises or answers anything but True or False."""
    try:
        value = declared(params) if callable(declared) else declared
    except Exception as exc:
        problems.append(f"{fact} of the {label} raised {type(exc).__name__}: {exc}")
        return None
    if not isinstance(value, (bool, np.bool_)):
        problems.append(f"{fact} of the {label} is {value!r}; it must be True or False")
        return None
    return bool(value)


def validate_spec(spec: Any) -> EstimatorSpec:
    """Check that ``spec`` satisfies the estimator protocol; return it.

    Raises
    ------
    SpecError
        Listing every problem found: the type, the name (lower-case letters, digits, ``-``,
        ``_``; no ``:``, ``,`` or ``=``, which the ``name:p=v`` syntax uses), missing callables,
        declared facts outside their allowed values, parameter names in :data:`RESERVED_PARAMETER_NAMES`
        (the message lists them), parameter defaults their own check refuses,
        variants, presets and exact limits naming unknown parameters.
    """
    if not isinstance(spec, EstimatorSpec):
        raise SpecError(f"an estimator spec must be a randattn.estimators.EstimatorSpec, got {type(spec).__name__}")
    problems: list[str] = []
    name = spec.name
    if not isinstance(name, str) or not name or not set(name) <= _NAME_CHARS or not name[0].isalpha():
        problems.append(f"name {name!r} must start with a letter and hold only lower-case letters, digits, '-' and '_'")
    for attr in ("draw", "reference"):
        if not callable(getattr(spec, attr)):
            problems.append(f"{attr} must be callable, got {type(getattr(spec, attr)).__name__}")
    if not isinstance(spec.forms, BatchedForms):  # its forms are checked when it is made
        problems.append(f"forms must be a randattn.estimators.BatchedForms, got {type(spec.forms).__name__}")
    for attr in ("describe", "keys_used", "promise", "log_denominator"):
        value = getattr(spec, attr)
        if value is not None and not callable(value):
            problems.append(f"{attr} must be callable or None, got {type(value).__name__}")
    if (isinstance(spec.forms, BatchedForms) and spec.forms.has("estimate_with_probabilities_and_keys_used")
            and spec.keys_used is None):
        problems.append("forms declares estimate_with_probabilities_and_keys_used but the spec declares no keys_used "
                        "(the counts it returns are keys_used's)")
    if (isinstance(spec.forms, BatchedForms)
            and spec.forms.has("estimate_with_probabilities_keys_used_and_log_denominator")
            and (spec.keys_used is None or spec.log_denominator is None)):
        problems.append("forms declares estimate_with_probabilities_keys_used_and_log_denominator but the spec "
                        "declares no keys_used or no log_denominator (what it returns beside the estimate is theirs)")
    for attr in ("summary", "source", "complexity"):
        if not isinstance(getattr(spec, attr), str):
            problems.append(f"{attr} must be a string")
    if not isinstance(spec.params, Mapping) or not all(isinstance(p, Param) for p in spec.params.values()):
        problems.append("params must map parameter names to randattn.estimators.Param")
        return _raise_if(spec, problems)
    for pname, param in spec.params.items():
        if pname in RESERVED_PARAMETER_NAMES:
            problems.append(f"parameter name {pname!r} is reserved by randattn (the reserved names: "
                            f"{', '.join(RESERVED_PARAMETER_NAMES)}); rename it")
        elif not isinstance(pname, str) or not pname.isidentifier() or keyword.iskeyword(pname):
            # every entry point takes the parameters as keyword arguments
            problems.append(f"parameter name {pname!r} is not a Python identifier (a keyword argument of every "
                            "entry point); use letters, digits and _ (e.g. top_k)")
        try:
            param.check(pname, param.default)
        except (TypeError, ValueError) as exc:
            problems.append(f"default of parameter {pname!r} is refused by its own check: {exc}")
    try:
        defaults = spec.resolve_params({})
    except (TypeError, ValueError) as exc:
        problems.append(f"the defaults do not resolve: {exc}")
        return _raise_if(spec, problems)
    facts = (("convergence", spec.convergence_of, CONVERGENCE), ("cost", spec.cost_of, COSTS),
             ("selection", spec.selection_of, SELECTIONS),
             ("query_placement", spec.query_placement_of, QUERY_PLACEMENTS),
             ("promise_on", spec.promise_on_of, PROMISE_QUANTITIES))
    for label, params in [("defaults", defaults), *((f"variant {v!r}", p) for v, p in spec.variants.items())]:
        try:
            resolved = spec.resolve_params(params)
        except (TypeError, ValueError) as exc:
            problems.append(f"{label} do not resolve: {exc}")
            continue
        for fact, getter, allowed in facts:
            try:
                value = getter(resolved)
            except Exception as exc:  # a declared fact must be computable for every legal configuration
                problems.append(f"{fact} of the {label} raised {type(exc).__name__}: {exc}")
                continue
            if value not in allowed:
                problems.append(f"{fact} of the {label} is {value!r}; allowed: {', '.join(allowed)}")
        is_random = _yes_or_no("is_random", spec.is_random, resolved, label, problems)
        if is_random is None or _yes_or_no("needs_samples", spec.needs_samples, resolved, label, problems) is None:
            continue
        if spec.convergence_of(resolved) == "exact" and is_random:
            problems.append(f"the {label} claim convergence 'exact' but is_random says they are random")
        if spec.promise is not None and spec.log_denominator is None and _denominator_promised(spec, resolved):
            problems.append(f"the {label} promise an accuracy of the denominator but the spec declares no "
                            "log_denominator (the sweep measures the promise on it)")
    for preset, params in spec.presets.items():
        unknown = sorted(set(params) - set(spec.params))
        if unknown:
            problems.append(f"preset {preset!r} sets unknown parameter(s) {', '.join(unknown)}")
    try:
        declared = [spec.masks_of(spec.resolve_params(p)) for p in [{}, *spec.variants.values()]]
    except Exception as exc:
        problems.append(f"masks could not be evaluated: {type(exc).__name__}: {exc}")
        declared = []
    for masks in declared:
        if not isinstance(masks, tuple) or None not in masks or not set(masks) <= set(DECLARABLE_MASKS):
            problems.append(f"masks must be a tuple holding None and optionally 'causal' and 'sliding', got {masks!r}")
            break
    if spec.promise is not None:
        for params in [{}, *spec.variants.values()]:
            try:
                promised = spec.promise_of(spec.resolve_params(params))
            except Exception as exc:
                problems.append(f"promise raised {type(exc).__name__}: {exc}")
                break
            if promised is not None and not all(0 < x < 1 for x in promised):
                problems.append(f"promise must give (epsilon, delta) in (0, 1) or None, got {promised!r}")
                break
    if spec.importance_weights is not None and not isinstance(spec.importance_weights, ImportanceWeights):
        problems.append("importance_weights must be an ImportanceWeights or None")
    elif spec.importance_weights is not None:
        for params in [{}, *spec.variants.values()]:
            try:
                weight_masks = spec.importance_weights.masks_of(spec.resolve_params(params))
            except Exception as exc:
                problems.append(f"importance_weights.masks could not be evaluated: {type(exc).__name__}: {exc}")
                break
            if None not in weight_masks or not set(weight_masks) <= set(DECLARABLE_MASKS):
                problems.append("importance_weights.masks must be a tuple holding None and optionally 'causal' and "
                                f"'sliding', got {weight_masks!r}")
                break
    for limit in spec.exact_limits:
        if not isinstance(limit, ExactLimit):
            problems.append(f"exact_limits must hold ExactLimit objects, got {type(limit).__name__}")
            continue
        try:
            params, _ = limit.resolve(16, 16)
            spec.resolve_params(params)
        except (TypeError, ValueError) as exc:
            problems.append(f"exact limit {limit.description!r} does not resolve: {exc}")
    return _raise_if(spec, problems)


def _raise_if(spec: EstimatorSpec, problems: list[str]) -> EstimatorSpec:
    if problems:
        raise SpecError(f"estimator spec {getattr(spec, 'name', '?')!r} is invalid:\n  - " + "\n  - ".join(problems))
    return spec
