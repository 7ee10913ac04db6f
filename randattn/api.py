"""The one-call Python API: ``randattn.estimate``."""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np

from randattn._validation import (check_choice, check_device, check_finite_on_device, check_positive_int,
                                  check_qkv_shapes, check_scale)
from randattn.estimators.base import Draws, EstimatorSpec, validate_spec
from randattn.estimators.masks import Mask, check_causal_shapes
from randattn.estimators.registry import get_spec

__all__ = ["estimate", "draw"]

BACKENDS = ("reference", "torch")


def _normalize_rng(seed: Any) -> np.random.Generator:
    if isinstance(seed, np.random.Generator):
        return seed
    if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool) and seed < 0:
        raise ValueError(f"seed must be a non-negative int (or None, or a numpy Generator), got {seed}")
    if seed is None or isinstance(seed, (int, np.integer, np.random.SeedSequence)) and not isinstance(seed, bool):
        return np.random.default_rng(seed)
    raise TypeError(f"seed must be None, an int or a numpy Generator, got {type(seed).__name__}")


def _spec_of(name: str | EstimatorSpec) -> EstimatorSpec:
    """A registered estimator's spec by name, or a spec object (validated) used as it is."""
    if isinstance(name, EstimatorSpec):
        return validate_spec(name)
    return get_spec(name)


def _mask_kwargs(spec: EstimatorSpec, mask: str | None, num_queries: int, num_keys: int,
                 params: dict[str, Any]) -> dict[str, Any]:
    """``{"mask": mask}`` for a supported non-default mask, ``{}`` for none (None, or ``"none"`` as the command line
    and the messages spell it); ValueError naming the estimator else."""
    # Parsed here, not by the spec, so that a value naming no mask is told the API's spellings, 'none' among them
    Mask.parse(mask)
    mask = None if mask == "none" else mask
    spec.check_mask(mask, params)
    if mask is None:
        return {}
    check_causal_shapes(num_queries, num_keys)
    return {"mask": mask}


def draw(
    name: str | EstimatorSpec,
    q_shape: tuple[int, ...],
    k_shape: tuple[int, ...],
    *,
    num_samples: int | None = None,
    seed: Any = None,
    replicates: int = 1,
    mask: str | None = None,
    **params: Any,
) -> Draws:
    """Make the random variables of estimator ``name`` (or of a spec object) for inputs of these shapes.

    Returns float64 numpy draws; ``mask`` (None, ``"causal"`` or ``"sliding:W"``) must be one the estimator
    supports.
    """
    return _draw(_spec_of(name), q_shape, k_shape, num_samples=num_samples, seed=seed, replicates=replicates,
                 mask=mask, **params)


def _draw(spec: EstimatorSpec, q_shape: Any, k_shape: Any, *, num_samples: int | None, seed: Any, replicates: int,
          mask: str | None, **params: Any) -> Draws:
    """:func:`draw` for a spec already looked up or validated (``estimate`` must not validate it twice per call)."""
    resolved = spec.resolve_params(params)
    q_shape, k_shape = _check_draw_shapes(q_shape, k_shape)
    masked = _mask_kwargs(spec, mask, q_shape[-2], k_shape[-2], resolved)
    replicates = check_positive_int("replicates", replicates)
    if spec.needs_samples_of(resolved):
        if num_samples is None:
            raise ValueError(f"estimator {spec.name!r} needs num_samples (S: its sample size, or its budget of keys "
                             "for a selection)")
        num_samples = check_positive_int("num_samples", num_samples)
    return spec.draw(tuple(q_shape), tuple(k_shape), num_samples=num_samples, replicates=replicates,
                     rng=_normalize_rng(seed), **resolved, **masked)


def _check_draw_shapes(q_shape: Any, k_shape: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes ``(..., N, D)`` and ``(..., M, D)`` of positive integers with equal batch dims and D, as ``estimate`` needs."""
    shapes = []
    for name, shape in (("q_shape", q_shape), ("k_shape", k_shape)):
        try:
            dims = tuple(shape)
        except TypeError:
            raise TypeError(f"{name} must be a tuple of ints like (..., tokens, head_dim), got {shape!r}") from None
        if len(dims) < 2:
            raise ValueError(f"{name} must have at least 2 dims (..., tokens, head_dim), got {dims}")
        for d in dims:
            check_positive_int(f"every dim of {name} {dims}", d)
        shapes.append(tuple(int(d) for d in dims))
    q_shape, k_shape = shapes
    if q_shape[:-2] != k_shape[:-2] or q_shape[-1] != k_shape[-1]:
        raise ValueError(f"q_shape {q_shape} and k_shape {k_shape} must share the batch dims and head_dim "
                         "(..., N, D) vs (..., M, D)")
    return q_shape, k_shape


class _NotGiven:
    """name, q, k or v not given by position (a keyword call, deprecated: :func:`_by_position`)."""

    def __repr__(self) -> str:
        return "<not given>"


_NOT_GIVEN: Any = _NotGiven()


def _by_position(name: Any, q: Any, k: Any, v: Any, params: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
    """name, q, k and v, taken from ``params`` (with a DeprecationWarning) where a caller named them as keywords.

    They are positional-only, so that an estimator's option reads as an option: ``k=4`` on top-k is an unknown
    option (whose message names S), not a second value for the keys.
    """
    given = {"name": name, "q": q, "k": k, "v": v}
    by_keyword = [key for key, value in given.items() if value is _NOT_GIVEN and key in params]
    if by_keyword:
        import warnings

        warnings.warn(f"randattn.estimate: passing {', '.join(by_keyword)} by keyword is deprecated; pass them by "
                      "position, estimate(name, q, k, v, ...): from randattn 0.3 they are positional-only",
                      DeprecationWarning, stacklevel=3)
        given.update({key: params.pop(key) for key in by_keyword})
    missing = [key for key, value in given.items() if value is _NOT_GIVEN]
    if missing:
        raise TypeError(f"estimate() missing {', '.join(missing)}: call estimate(name, q, k, v, ...)")
    return given["name"], given["q"], given["k"], given["v"]


def _without_not_given(function: Any) -> inspect.Signature:
    """``function``'s signature as callers should read it: name, q, k and v required and positional-only (their
    default is only the deprecated keyword call's)."""
    signature = inspect.signature(function)
    return signature.replace(parameters=[
        parameter.replace(default=inspect.Parameter.empty) if parameter.default is _NOT_GIVEN else parameter
        for parameter in signature.parameters.values()])


def estimate(
    name: str | EstimatorSpec = _NOT_GIVEN,
    q: Any = _NOT_GIVEN,
    k: Any = _NOT_GIVEN,
    v: Any = _NOT_GIVEN,
    /,
    *,
    num_samples: int | None = None,
    seed: Any = None,
    replicates: int | None = None,
    scale: float | None = None,
    backend: str = "reference",
    dtype: Any = None,
    device: Any = None,
    mask: str | None = None,
    **params: Any,
) -> Any:
    """Estimate attention with a registered estimator, in one call.

    Parameters
    ----------
    name : str or EstimatorSpec
        A registered estimator (``randattn.list_estimators()``), or a spec object (checked with
        :func:`~randattn.estimators.base.validate_spec`) that need not be registered.
    q : (..., N, D) array or tensor
    k : (..., M, D) array or tensor
    v : (..., M, Dv) array or tensor
        By position, as ``name``: an estimator's option is never taken for them (``k=4`` is an option, and top-k
        has none by that name: its budget is ``num_samples``). Naming them as keywords still works, with a
        DeprecationWarning, until randattn 0.3.
    num_samples : int, optional
        S, the number of random samples (features, proposals' samples) or the key budget of a decode-time
        estimator (top-k's kept keys, MagicPIG's hash tables); required by the estimators that take one, and
        ignored by those that take none (softmax, local attention, adaptive vAttention, which sizes its own
        sample: ``randattn estimators`` lists which), so that one S can be given to every estimator in a loop;
        adaptive vAttention still refuses an S that is not a positive integer, as its draw does.
    seed : int or numpy.random.Generator, optional
        The draws are made once, in float64 numpy, from this seed and then moved to the
        backend: the same seed gives the same draws whichever backend, dtype or device
        runs, so a GPU run can be checked against the float64 reference by its seed.
    replicates : int, optional
        R independent replicates; the result then has a leading dim R. They come from one generator, so
        replicate 0 of R need not equal the call without ``replicates`` (RA draws every replicate's
        uniforms before its noise): compare runs of the same R, or seed each replicate yourself.
    scale : float, optional
        Temperature; default ``D ** -0.5``.
    backend : {"reference", "torch"}
        ``reference``: numpy float64 (returns a numpy array), the papers' equations written out, some of
        them query by query: the check, not the workhorse. ``torch``: the batched implementation (returns a
        tensor on ``device``), for anything long: causal vAttention over 2,048 tokens (D = 64, one head)
        takes 9.1 s on the reference and 0.48 s on torch (2-core CPU), and the reference's time grows
        with the square of the tokens or faster.
    dtype : torch dtype, optional
        torch backend only: float32 (the default) or float64. Half precision is refused: its 11-bit
        significand cannot hold the draws' integers (top-k's budget of 2,049 becomes 2,048).
    device : str or torch.device, optional
        torch backend only; default CPU.
    mask : {None, "none", "causal", "sliding:W"}
        None: every query sees every key. ``"causal"``: key m is visible to query n iff
        ``m <= n + M - N``; ``"sliding:W"``: also ``m > n + M - N - W``, the last W of those
        (:mod:`randattn.estimators.masks`). The estimator must declare it supports it (its spec's
        ``masks``), else ValueError naming the estimator.
    **params
        Estimator options (see ``randattn estimators``); unknown names raise ValueError. No option is named
        like an argument above: specs are refused with such names
        (:data:`~randattn.estimators.base.RESERVED_PARAMETER_NAMES`).

    Returns
    -------
    (..., N, Dv), or (R, ..., N, Dv) with ``replicates=R``.

    Examples
    --------
    >>> import numpy as np, randattn
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.normal(size=(3, 2, 16, 8))
    >>> randattn.estimate("rfa", q, k, v, num_samples=64, seed=1).shape
    (2, 16, 8)
    """
    name, q, k, v = _by_position(name, q, k, v, params)
    check_choice("backend", backend, BACKENDS)
    spec = _spec_of(name)
    resolved = spec.resolve_params(params)
    check_qkv_shapes(q, k, v)
    check_finite_on_device(q=q, k=k, v=v)
    check_scale(scale, q.shape[-1])  # one statement of the rule for every estimator, plugins included
    masked = _mask_kwargs(spec, mask, q.shape[-2], k.shape[-2], resolved)
    draws = _draw(spec, tuple(q.shape), tuple(k.shape), num_samples=num_samples, seed=seed,
                 replicates=1 if replicates is None else replicates, mask=mask, **resolved)
    if backend == "reference":
        if dtype is not None or device is not None:
            raise ValueError("dtype and device apply to backend='torch' only (the reference is float64 numpy)")
        out = spec.reference(q, k, v, draws, scale=scale, **resolved, **masked)
    else:
        import torch

        dtype = torch.float32 if dtype is None else dtype
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"dtype must be a floating torch dtype, got {dtype!r}")
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}: half precision cannot hold "
                             "the draws (a budget of 2,049 keys is 2,048 in float16, and bfloat16 is refused by the "
                             "selection)")
        device = check_device(device)
        from randattn._precision import full_precision_matmul
        from randattn._tensors import input_tensor

        def to(array: Any) -> Any:  # a read-only array (Activations.qkv gives them) is shared without torch's warning
            return input_tensor(array if isinstance(array, torch.Tensor) else np.asarray(array), device=device,
                                dtype=dtype)

        with full_precision_matmul():  # no TF32 / bfloat16 products; the caller's settings come back after
            out = spec.batched(to(q), to(k), to(v), draws.to_torch(device=device, dtype=dtype), scale=scale,
                               **resolved, **masked)
    return out[0] if replicates is None else out


estimate.__signature__ = _without_not_given(estimate)
