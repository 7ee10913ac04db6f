r"""The estimates of one block of a unit and its probabilities' squared error: which way to measure it (issue #26).

:class:`BlockEstimator` runs an estimator on a block of (cells, replicates) and measures the
squared error of its implied probabilities the cheapest way whose rounding is provably negligible:

1. from the probabilities' low-rank factors (:mod:`~randattn.analysis.probability_error`), where
   they exist and pay (:func:`~randattn.analysis.probability_error.factored_pays`), in float32 and
   then float64 while the bound allows;
2. else, in a float64 run under ``dtype="auto"``, from the estimator's float32 probability product
   where its bound allows (:func:`~randattn.analysis.probability_error.probability_rounding_negligible`);
3. else densely, in the run's dtype (the float64 reference on the reference backend).

Every way gives the same estimates; the probabilities' error differs between them by at most
:data:`PROBABILITY_ROUNDING_RTOL` of itself.

Where the unit's truth is tiled (:mod:`~randattn.analysis.exact_cache`: no K x M array is held), the error is
taken by key tiles instead (:meth:`BlockEstimator.estimate` with ``log_normaliser``): for each tile of
:data:`key tile <probability_key_tile>` keys the exact probabilities are formed again from the log-normaliser and
the estimator's from its factors (:math:`L R_{:,tile}`, in float64) where it has them, else sliced from the
``(R_b, C_b, K, M)`` probabilities of its ``estimate_with_probabilities`` form (the one call that gives the block's
estimates), else by the estimator itself with ``v`` the tile's one-hot columns (every estimator is linear in ``v``
given its draws, so this is column ``m`` of :math:`\hat P`; a whole estimator call per tile); the squared
differences are summed in float64. Memory: the block's ``(R_b, C_b, K, T)`` per tile, never ``K x M``, except the
dense probabilities of the second way, which :func:`columns_skip_reason` allows only where one head's and replicate's
``K x M`` fit the budget (the calibration measures that path and sizes the blocks to it).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import numpy as np

from randattn._tensors import input_tensor
from randattn.analysis.plan import EstimatorConfig
from randattn.analysis.probability_error import (
    factored_pays,
    factored_rounding_negligible,
    factored_sq_errors,
    probability_rounding_negligible,
    row_errors,
)
from randattn.estimators.base import Draws
from randattn.estimators.masks import NO_MASK, Mask

__all__ = ["PROBABILITY_KEY_TILE", "PROBABILITY_ROUNDING_RTOL", "BlockEstimator", "ProbabilitiesSkippedWarning",
           "QueryFacts", "columns_skip_reason"]

#: keys per tile of the tiled probability error. Fixed, so that the sum's order (and so its bits) does not depend on
#: the memory budget. 256: causal RFA (S = 64, 4096 tokens, 2 cores) takes 0.80 s for a call with 64 value columns,
#: 0.88 s with 256 and 5.9 s with 1024, so 256 columns per call is the cheapest per column measured
PROBABILITY_KEY_TILE = 256
#: above this many entries of an M x M identity (1024 x 1024, as the tiled truth's threshold) an estimator without a
#: probability form is given one-hot value columns a tile at a time; below it, the identity at once (the bits of
#: every earlier table)
IDENTITY_ABOVE = 2**20


class ProbabilitiesSkippedWarning(UserWarning):
    """A unit's probability error was not computed (prob_mse is NaN); the message says why."""


class QueryFacts(NamedTuple):
    """What a block's estimate gave per (replicate, cell, query) from its own selection, as float64 ``(R_b, C_b, N)``
    host arrays: the keys each query read and the log of its estimated softmax normaliser; None where the
    estimator's forms did not give it (the unit then asks the spec's separate ``keys_used`` or ``log_denominator``,
    :meth:`BlockEstimator.keys_used`, :meth:`BlockEstimator.log_denominator`)."""

    keys_used: np.ndarray | None = None
    log_denominator: np.ndarray | None = None


def columns_skip_reason(label: str, mask: Mask, queries: int, keys: int, itemsize: int,
                        budget: int) -> str | None:
    """Why a tiled unit leaves prob_mse NaN, or None where its probabilities may be formed by key tiles.

    An estimator without probability factors forms its probabilities densely (its ``estimate_with_probabilities``)
    or column by column, as much work as forming them densely (a K x M product per replicate): either is done where
    today's dense pass could have run, one head's and replicate's K x M probabilities (``itemsize`` bytes each)
    within ``budget``; beyond, the time would be that of a pass the budget forbids, and the column is left NaN with
    this reason.
    """
    dense = queries * keys * itemsize
    if dense <= budget:
        return None
    from randattn.analysis.cell_memory import format_bytes

    where = f" under mask={mask.kind!r}" if mask.masked else ""
    return (f"prob_mse not computed: {label} has no probability factors{where}, and one head's "
            f"{queries} x {keys} probabilities ({format_bytes(dense)} per replicate) exceed the memory budget of "
            f"{format_bytes(budget)}; raise --max-memory, measure fewer --queries, or use --no-probabilities")

#: a float64 run takes an estimator's float32 probability product (``estimate_with_float32_probabilities``), and any
#: run the factored probability error (:mod:`~randattn.analysis.probability_error`), only where its rounding bound
#: changes every (replicate, cell)'s probability squared error by at most this fraction; a block where it may change
#: more is recomputed the dense way. Two orders below the ~10% standard error of a prob_mse over R = 32 replicates
PROBABILITY_ROUNDING_RTOL = 1e-3


def _per_query_array(est: EstimatorConfig, values, expected: tuple[int, ...], form: str = "keys_used") -> np.ndarray:
    """The per-query ``values`` of ``est``'s ``form`` (its keys-used counts, or its log-denominators) as a float64
    host array of shape ``expected`` ``(R_b, C_b, N)``.

    Raises
    ------
    ValueError
        The values have another shape, naming the estimator and the form.
    """
    import torch

    if tuple(values.shape) != expected:
        raise ValueError(f"{form} of estimator {est.label!r} returned shape {tuple(values.shape)}; expected "
                         f"(R, ..., N) = {expected}")
    return values.to(device="cpu", dtype=torch.float64).numpy()


class BlockEstimator:
    """Estimates and probability squared errors of blocks of a sweep's units, on one backend.

    Parameters
    ----------
    scale : float
        The logit temperature.
    probabilities : bool
        Whether the run measures the implied probabilities' error (``SweepConfig.probabilities``).
    dtype : str
        The run's dtype setting (``SweepConfig.dtype``: ``"auto"``, ``"float32"`` or ``"float64"``).
    torch : module, optional
        The torch module on the torch backend; None: the float64 numpy reference.
    device : torch.device, optional
        Where the torch backend computes.
    """

    def __init__(self, scale: float, probabilities: bool, dtype: str, *, torch: Any = None, device: Any = None) -> None:
        self.scale = scale
        self.probabilities = probabilities
        self.dtype = dtype
        self.torch = torch
        self.device = device

    def dtype_name(self, est: EstimatorConfig) -> str:
        """The dtype ``est`` computes in: float64 on the reference backend, else its torch dtype under the run's."""
        return "float64" if self.torch is None else est.torch_dtype_name(self.dtype)

    def rounds_probabilities(self, spec, est: EstimatorConfig) -> bool:
        """Whether this run may take ``spec``'s float32 probability product (a float64 run under ``dtype="auto"``)."""
        return (self.torch is not None and self.probabilities and self.dtype == "auto"
                and self.dtype_name(est) == "float64" and spec.forms.has("estimate_with_float32_probabilities"))

    def factors_pay(self, spec, est: EstimatorConfig, rank: int | None, queries: int) -> bool:
        """Whether this block measures the probability error from the estimator's factors.

        On the torch backend, with probabilities, where the estimator has factors and they are
        the faster way (:func:`~randattn.analysis.probability_error.factored_pays`), in float32
        runs and in float64 runs under ``dtype="auto"`` (an explicit float64 run stays float64).
        """
        if (self.torch is None or not self.probabilities or not spec.forms.has("estimate_with_probability_factors")
                or not factored_pays(rank, queries)):
            return False
        return self.dtype_name(est) == "float32" or self.dtype == "auto"

    def estimate(self, spec, est: EstimatorConfig, q, k, v, draws: Draws, exact_probs, exact_probs32=None, *,
                 full_precision: bool = False, rank: int | None = None, exact_sq_norms=None,
                 exact64: Callable[[], Any] | None = None, mask: Mask = NO_MASK):
        """Estimates ``(R_b, C_b, N, Dv)`` and the probabilities' squared error ``(R_b, C_b)`` (or None).

        Parameters
        ----------
        spec : EstimatorSpec
        est : EstimatorConfig
        q, k, v : (C_b, N, D), (C_b, M, D), (C_b, M, Dv) float64 ndarrays
            The block's cells.
        draws : Draws
            The block's draws ``(R_b, C_b, ...)``.
        exact_probs : (C_b, N, M) or None
            The exact probabilities (a run-dtype tensor on the torch backend); None without probabilities.
        exact_probs32 : (C_b, N, M) tensor, optional
            The exact probabilities in float32, if at hand.
        full_precision : bool
            Force the dense product in the run's dtype (the calibration measures that, the larger working set).
        rank : int, optional
            The unit's S: the rank of the factored probabilities, where they have factors.
        exact_sq_norms : (C_b, N) float64 tensor, optional
            The exact probabilities' squared row norms.
        exact64 : callable, optional
            Gives the exact probabilities as a float64 tensor (for the factored float64 retry).
        mask : Mask, optional
            The layer's mask; its keywords go to every estimator call (a form that returns
            None for it, as the probability factors of a causal estimator may, is taken as absent).

        Returns
        -------
        out : (R_b, C_b, N, Dv)
            As computed: a torch tensor in the run's dtype on its device, or the reference's float64 array.
        prob_sq : (R_b, C_b) float64 ndarray or None
            None without probabilities.
        facts : QueryFacts
            The keys each query read and its log-denominator, where a one-pass form of the spec gave them from the
            estimate's own selection (:meth:`_with_probabilities`); None fields otherwise.
        """
        if (not full_precision and exact_sq_norms is not None and exact64 is not None
                and self.factors_pay(spec, est, rank, q.shape[-2])):
            factored = self._factored(spec, est, q, k, v, draws, exact_probs32, exact_sq_norms, exact64, mask=mask)
            if factored is not None:
                return (*factored, QueryFacts())
        if not full_precision and self.rounds_probabilities(spec, est):
            rounded = self._float32_product(spec, est, q, k, v, draws,
                                            exact_probs if exact_probs32 is None else exact_probs32, mask=mask)
            if rounded is not None:
                return (*rounded, QueryFacts())
        if self.torch is None:
            return (*self._reference(spec, est, q, k, v, draws, exact_probs, mask=mask), QueryFacts())
        return self._dense(spec, est, q, k, v, draws, exact_probs, mask=mask)

    def tiled_estimate(self, spec, est: EstimatorConfig, q, k, v, draws: Draws, log_normaliser, *,
                       mask: Mask = NO_MASK, key_tile: int = PROBABILITY_KEY_TILE, columns: bool = True):
        """:meth:`estimate` where the truth is tiled: the estimates, the probabilities' squared error
        ``(R_b, C_b)`` summed over key tiles (module docstring; None without probabilities) and the
        :class:`QueryFacts` the estimate's form gave, as :meth:`estimate` returns them.

        Parameters
        ----------
        log_normaliser : (C_b, K) float64 tensor
            The exact log-normaliser of the block's cells (:meth:`~randattn.analysis.exact_cache.ExactCache.
            log_normaliser`).
        key_tile : int
            Keys per tile (:data:`PROBABILITY_KEY_TILE`).
        columns : bool
            Whether an estimator without factors may form its probabilities by key tiles
            (:func:`columns_skip_reason`); if not, its probability error is None.
        """
        from randattn.analysis.probability_error import tiled_sq_errors

        torch_mod = self.torch
        masked = mask.estimator_kwargs
        tile = int(key_tile)
        if torch_mod is None:  # the reference: numpy in, numpy out
            out = np.asarray(spec.reference(q, k, v, draws, scale=self.scale, **est.params, **masked), dtype=np.float64)
            if not self.probabilities or not columns:
                return out, None, QueryFacts()

            def columns_of(k0: int, k1: int):
                onehot = np.zeros((*k.shape[:-1], k1 - k0))
                onehot[..., np.arange(k0, k1), np.arange(k1 - k0)] = 1.0
                return np.asarray(spec.reference(q, k, onehot, draws, scale=self.scale, **est.params, **masked),
                                  dtype=np.float64)

            return out, tiled_sq_errors(columns_of, q, k, log_normaliser, scale=self.scale, mask=mask.kind,
                                        key_tile=tile), QueryFacts()
        import torch

        dt = getattr(torch, self.dtype_name(est))
        tq, tk, tv = (input_tensor(a, device=self.device, dtype=dt) for a in (q, k, v))
        tdraws = draws.to_torch(device=self.device, dtype=dt)
        with torch.no_grad():
            if not self.probabilities:
                out, facts = self._estimate_alone(spec, est, tq, tk, tv, tdraws, mask)
                return out, None, facts
            factors, facts = None, QueryFacts()
            if spec.forms.has("estimate_with_probability_factors"):
                factors = spec.forms.get("estimate_with_probability_factors")(tq, tk, tv, tdraws, scale=self.scale,
                                                                              **est.params, **masked)
            if factors is not None:
                out, left, right = factors
                left64 = left.to(torch.float64)

                def columns_of(k0: int, k1: int):
                    return left64 @ right[..., k0:k1].to(torch.float64)
            elif not columns:
                out, facts = self._estimate_alone(spec, est, tq, tk, tv, tdraws, mask)
                return out, None, facts
            elif spec.forms.has("estimate_with_probabilities"):
                # one pass gives the estimate and every column: one estimator call where one-hot tiles would make
                # M / key_tile of them (each a whole estimate: MagicPIG hashing again, 79 times at 20,000 keys);
                # its (R_b, C_b, K, M) probabilities are what `columns` allows and what the calibration measures
                out, probs, facts = self._with_probabilities(spec, est, tq, tk, tv, tdraws, mask)

                def columns_of(k0: int, k1: int):
                    return probs[..., k0:k1]
            elif spec.forms.has("probabilities"):
                # two estimator passes, the estimate and the probability form, where one-hot tiles would make
                # M / key_tile of them (128 at 32,768 keys): the same (R_b, C_b, K, M) as the one-pass form
                out, facts = self._estimate_alone(spec, est, tq, tk, tv, tdraws, mask)
                form_probs = spec.forms.get("probabilities")(tq, tk, tdraws, scale=self.scale, **est.params, **masked)

                def columns_of(k0: int, k1: int):
                    return form_probs[..., k0:k1]
            else:
                out = spec.batched(tq, tk, tv, tdraws, scale=self.scale, **est.params, **masked)

                def columns_of(k0: int, k1: int):
                    onehot = torch.zeros((*k.shape[:-1], k1 - k0), device=self.device, dtype=dt)
                    onehot[..., torch.arange(k0, k1), torch.arange(k1 - k0)] = 1.0
                    return spec.batched(tq, tk, onehot, tdraws, scale=self.scale, **est.params, **masked)

            tq64, tk64 = (input_tensor(a, device=self.device, dtype=torch.float64) for a in (q, k))
            sq = tiled_sq_errors(columns_of, tq64, tk64, log_normaliser, scale=self.scale, mask=mask.kind,
                                 key_tile=tile)
        return out, sq, facts

    def keys_used(self, spec, est: EstimatorConfig, q, k, draws: Draws, *, mask: Mask = NO_MASK) -> np.ndarray:
        """float64 ``(R_b, C_b, N)``: the keys each query's estimate reads (:attr:`~randattn.estimators.base.
        EstimatorSpec.keys_used`), by :meth:`_per_query` (a selection by scores may differ between float32 and
        float64 where candidates nearly tie, so it runs in the estimate's dtype)."""
        return self._per_query(spec.keys_used, "keys_used", est, q, k, draws, mask)

    def log_denominator(self, spec, est: EstimatorConfig, q, k, draws: Draws, *, mask: Mask = NO_MASK) -> np.ndarray:
        """float64 ``(R_b, C_b, N)``: the log of each query's estimated softmax normaliser
        (:attr:`~randattn.estimators.base.EstimatorSpec.log_denominator`), by :meth:`_per_query`."""
        return self._per_query(spec.log_denominator, "log_denominator", est, q, k, draws, mask)

    def _per_query(self, fact: Callable[..., Any], form: str, est: EstimatorConfig, q, k, draws: Draws,
                   mask: Mask) -> np.ndarray:
        """``fact(q, k, draws, ...)`` of the block's own draws as a float64 ``(R_b, C_b, N)`` host array, in the dtype
        its estimate ran in; on the torch CPU for the reference backend (such facts are declared in torch only).

        Raises
        ------
        ValueError
            The values do not have the layout ``(R_b, C_b, N)``, naming the estimator and ``form``.
        """
        import torch

        device = self.device if self.torch is not None else None
        dt = getattr(torch, self.dtype_name(est))
        tq, tk = (input_tensor(a, device=device, dtype=dt) for a in (q, k))
        with torch.no_grad():
            values = fact(tq, tk, draws.to_torch(device=device, dtype=dt), scale=self.scale, **est.params,
                          **mask.estimator_kwargs)
        return _per_query_array(est, values, (draws.replicates, *q.shape[:-1]), form)

    def _one_hot_sq_errors(self, spec, est: EstimatorConfig, tq, tk, tdraws: Draws, exact_probs, mask: Mask,
                           dt) -> np.ndarray:
        """float64 ``(R_b, C_b)``: the squared probability error of an estimator without a probability form, from
        its estimate of :data:`PROBABILITY_KEY_TILE` one-hot value columns at a time against the dense exact
        probabilities: ``M / tile`` estimates of ``(K, tile)`` each, where one estimate of the ``M x M`` identity
        would hold ``M^2`` values (2 GiB in float64 at 16,384 keys) for a ``K x M`` truth."""
        torch = self.torch
        m, total = tk.shape[-2], None
        exact = torch.as_tensor(exact_probs, device=self.device, dtype=dt)
        for k0 in range(0, m, PROBABILITY_KEY_TILE):
            k1 = min(k0 + PROBABILITY_KEY_TILE, m)
            onehot = torch.zeros((*tk.shape[:-1], k1 - k0), device=self.device, dtype=dt)
            onehot[..., torch.arange(k0, k1), torch.arange(k1 - k0)] = 1.0
            columns = spec.batched(tq, tk, onehot, tdraws, scale=self.scale, **est.params, **mask.estimator_kwargs)
            diff = columns.to(torch.float64).sub_(exact[..., k0:k1])
            part = torch.linalg.vecdot(diff.flatten(-2), diff.flatten(-2))  # (R_b, C_b)
            total = part if total is None else total.add_(part)
        return total.cpu().numpy()

    def _reference(self, spec, est: EstimatorConfig, q, k, v, draws: Draws, exact_probs, mask: Mask = NO_MASK):
        """:meth:`estimate` by the float64 numpy reference; the probabilities as its estimate of the identity."""
        masked = mask.estimator_kwargs
        m = k.shape[-2]
        out = np.asarray(spec.reference(q, k, v, draws, scale=self.scale, **est.params, **masked), dtype=np.float64)
        prob_sq = None
        if self.probabilities:
            eye = np.broadcast_to(np.eye(m), (*k.shape[:-1], m))
            probs = np.asarray(spec.reference(q, k, eye, draws, scale=self.scale, **est.params, **masked),
                               dtype=np.float64)
            prob_sq = ((probs - exact_probs) ** 2).sum(axis=(-2, -1))
        return out, prob_sq

    def _dense(self, spec, est: EstimatorConfig, q, k, v, draws: Draws, exact_probs, mask: Mask = NO_MASK):
        """:meth:`estimate` by the batched torch form, the probabilities formed densely in the run's dtype."""
        torch = self.torch
        masked = mask.estimator_kwargs
        m = k.shape[-2]
        dt = getattr(torch, self.dtype_name(est))
        tq, tk, tv = (input_tensor(a, device=self.device, dtype=dt) for a in (q, k, v))
        tdraws = draws.to_torch(device=self.device, dtype=dt)
        with torch.no_grad():
            prob_sq, facts = None, QueryFacts()
            if not self.probabilities:
                out, facts = self._estimate_alone(spec, est, tq, tk, tv, tdraws, mask)
            elif spec.forms.has("estimate_with_probabilities"):
                # one pass: the features and weights the two results share are computed once (same bits as two calls)
                out, probs, facts = self._with_probabilities(spec, est, tq, tk, tv, tdraws, mask)
            else:
                out = spec.batched(tq, tk, tv, tdraws, scale=self.scale, **est.params, **masked)
                if spec.forms.has("probabilities"):
                    probs = spec.forms.get("probabilities")(tq, tk, tdraws, scale=self.scale, **est.params, **masked)
                elif m * m > IDENTITY_ABOVE:
                    prob_sq = self._one_hot_sq_errors(spec, est, tq, tk, tdraws, exact_probs, mask, dt)
                    return out, prob_sq, facts
                else:
                    eye = torch.eye(m, device=self.device, dtype=dt).expand(*k.shape[:-1], m)
                    probs = spec.batched(tq, tk, eye, tdraws, scale=self.scale, **est.params, **masked)
            if self.probabilities:
                # in place in the run's dtype; the N squared row norms summed in float64
                prob_sq = row_errors(probs, torch.as_tensor(exact_probs, device=self.device, dtype=probs.dtype))
                prob_sq = prob_sq.square_().sum(-1).cpu().numpy()
                del probs
        return out, prob_sq, facts

    def _estimate_alone(self, spec, est: EstimatorConfig, tq, tk, tv, tdraws: Draws, mask: Mask):
        """``(out, facts)`` where no probabilities are measured: by a one-pass form where the spec declares one
        (its probabilities dropped: the selection estimators form them for the estimate anyway, and their keys-used
        counts and log-denominators then need no second selection), else ``batched`` and empty :class:`QueryFacts`."""
        if self._one_pass_form(spec, est) is not None:
            out, _, facts = self._with_probabilities(spec, est, tq, tk, tv, tdraws, mask)
            return out, facts
        return (spec.batched(tq, tk, tv, tdraws, scale=self.scale, **est.params, **mask.estimator_kwargs),
                QueryFacts())

    def wants_log_denominator(self, spec, est: EstimatorConfig) -> bool:
        """Whether ``est``'s promise is on the denominator, so that its log-denominators are measured."""
        return spec.promise_of(est.params) is not None and spec.promise_on_of(est.params) == "denominator"

    def _one_pass_form(self, spec, est: EstimatorConfig) -> str | None:
        """The one-pass form that gives what ``est``'s rows need beside its estimate from one selection: with its
        log-denominator where it is measured and the spec has such a form, else with the keys used; None where the
        spec declares neither."""
        if (self.wants_log_denominator(spec, est)
                and spec.forms.has("estimate_with_probabilities_keys_used_and_log_denominator")):
            return "estimate_with_probabilities_keys_used_and_log_denominator"
        if spec.forms.has("estimate_with_probabilities_and_keys_used"):
            return "estimate_with_probabilities_and_keys_used"
        return None

    def _with_probabilities(self, spec, est: EstimatorConfig, tq, tk, tv, tdraws: Draws, mask: Mask):
        """``(out, probs, facts)`` by ``estimate_with_probabilities``, with the :class:`QueryFacts` a one-pass form
        of the spec gives from the same selection (:meth:`_one_pass_form`; empty without one)."""
        masked = mask.estimator_kwargs
        form = self._one_pass_form(spec, est)
        if form is None:
            out, probs = spec.forms.get("estimate_with_probabilities")(tq, tk, tv, tdraws, scale=self.scale,
                                                                       **est.params, **masked)
            return out, probs, QueryFacts()
        out, probs, counts, *logs = spec.forms.get(form)(tq, tk, tv, tdraws, scale=self.scale, **est.params, **masked)
        expected = (tdraws.replicates, *tq.shape[:-1])
        return out, probs, QueryFacts(_per_query_array(est, counts, expected),
                                      _per_query_array(est, logs[0], expected, "log_denominator") if logs else None)

    def _factored(self, spec, est: EstimatorConfig, q, k, v, draws: Draws, exact32, sq_norms,
                  exact64: Callable[[], Any], mask: Mask = NO_MASK):
        """:meth:`estimate` through the probabilities' factors, or None where they have none or the bound is loose.

        The error is taken in float32 where its bound allows, else from the same factors in float64
        (``exact64``: a callable giving the exact probabilities as a float64 tensor), else None.
        """
        torch = self.torch
        dt = getattr(torch, self.dtype_name(est))
        tq, tk, tv = (input_tensor(a, device=self.device, dtype=dt) for a in (q, k, v))
        with torch.no_grad():
            result = spec.forms.get("estimate_with_probability_factors")(
                tq, tk, tv, draws.to_torch(device=self.device, dtype=dt), scale=self.scale, **est.params,
                **mask.estimator_kwargs)
            if result is None:  # no factors for this variant (e.g. under a causal mask)
                return None
            out, left, right = result
            sq, bound = factored_sq_errors(left.to(torch.float32), right.to(torch.float32),
                                           torch.as_tensor(exact32, device=self.device, dtype=torch.float32), sq_norms)
            if not factored_rounding_negligible(sq, bound, PROBABILITY_ROUNDING_RTOL):
                # errors too small for float32's bound: the same factors in float64 cost about the dense pass
                sq, bound = factored_sq_errors(left.to(torch.float64), right.to(torch.float64), exact64(), sq_norms)
                if not factored_rounding_negligible(sq, bound, PROBABILITY_ROUNDING_RTOL):
                    return None
        return out, sq.cpu().numpy()

    def _float32_product(self, spec, est: EstimatorConfig, q, k, v, draws: Draws, exact_probs,
                         mask: Mask = NO_MASK):
        """:meth:`estimate` through the float32 probability product, or None where its bound is too loose."""
        torch = self.torch
        tq, tk, tv = (input_tensor(a, device=self.device, dtype=torch.float64) for a in (q, k, v))
        with torch.no_grad():
            result = spec.forms.get("estimate_with_float32_probabilities")(
                tq, tk, tv, draws.to_torch(device=self.device, dtype=torch.float64), scale=self.scale, **est.params,
                **mask.estimator_kwargs)
            if result is None:  # no float32 product for this variant
                return None
            out, probs, bound = result
            exact32 = torch.as_tensor(exact_probs, device=self.device, dtype=torch.float32)
            row_err = row_errors(probs, exact32)
            del probs
            if not probability_rounding_negligible(row_err, bound, torch.linalg.vector_norm(exact32, dim=-1),
                                                   PROBABILITY_ROUNDING_RTOL):
                return None
        return out, row_err.square_().sum(-1).cpu().numpy()
