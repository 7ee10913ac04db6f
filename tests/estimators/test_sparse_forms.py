"""``sparse.forms.WeightedKeysForms``, the forms every decode-time estimator shares, against the weighted softmax of
the ``sparse`` package docstring written out here with plain exponentials on a tiny hand-made selection (logits of
order one, so nothing overflows; 1e-13, the float64 rounding of a handful of sums), and the names its forms answer
to when called wrongly."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from randattn.estimators import magicpig, topk, vattention
from randattn.estimators.base import Draws, EstimatorOptions
from randattn.estimators.sparse import batched as sparse_batched
from randattn.estimators.sparse import reference as sparse_reference
from randattn.estimators.sparse.forms import WeightedKeysForms

INF = math.inf
#: one query batch of N = 2 over M = 4 keys: key 3 hidden from query 0 (the causal mask of a 2-over-4 decode)
LOGITS = np.array([[0.3, -1.2, 0.8, -INF], [1.1, 0.4, -0.5, 0.2]])
#: two replicates' log weights: key 1 left out of query 0 in replicate 0, a sampled key weighing 3 and 2
LOG_WEIGHTS = np.array([[[0.0, -INF, math.log(3.0), 0.0], [0.0, 0.0, -INF, math.log(2.0)]],
                        [[0.0, 0.0, 0.0, 0.0], [-INF, math.log(2.0), 0.0, 0.0]]])
V = np.array([[1.0, -2.0], [0.5, 3.0], [-1.0, 0.25], [2.0, 2.0]])


def _written_out(replicate: int, query: int) -> tuple[np.ndarray, np.ndarray, int, float]:
    """``(out, probabilities, keys read, log D)`` of one query: sum w e^l v / sum w e^l over the keys it reads."""
    weights = [math.exp(LOG_WEIGHTS[replicate, query, m]) if LOGITS[query, m] > -INF else 0.0 for m in range(4)]
    terms = [w * math.exp(LOGITS[query, m]) if w > 0 else 0.0 for m, w in enumerate(weights)]
    total = sum(terms)
    out = sum(t * V[m] for m, t in enumerate(terms)) / total
    return out, np.array(terms) / total, sum(w > 0 for w in weights), math.log(total)


def _forms(backend, *, same_in_every_replicate=False, as_array=np.asarray):
    log_weights = LOG_WEIGHTS[0] if same_in_every_replicate else LOG_WEIGHTS

    def weighted_scores(q, k, v, draws, options):
        return as_array(LOGITS), as_array(log_weights), as_array(V)

    return WeightedKeysForms(EstimatorOptions, weighted_scores, backend, same_in_every_replicate)


BACKENDS = [(sparse_reference, np.asarray), (sparse_batched, lambda a: torch.as_tensor(a, dtype=torch.float64))]


@pytest.mark.parametrize("backend, as_array", BACKENDS, ids=["reference", "batched"])
def test_every_form_is_the_weighted_softmax_written_out(backend, as_array):
    forms = _forms(backend, as_array=as_array)
    draws = Draws({}, 2)
    q = k = np.zeros((2, 4, 1))
    combined = forms.estimate_with_probabilities_keys_used_and_log_denominator(q, k, V, draws, None)
    out, probabilities, keys, log_den = (np.asarray(a) for a in combined)
    for r in range(2):
        for n in range(2):
            want_out, want_p, want_keys, want_log_den = _written_out(r, n)
            np.testing.assert_allclose(out[r, n], want_out, rtol=1e-13, atol=1e-13)
            np.testing.assert_allclose(probabilities[r, n], want_p, rtol=1e-13, atol=1e-13)
            assert keys[r, n] == want_keys
            assert log_den[r, n] == pytest.approx(want_log_den, rel=1e-13, abs=1e-13)
    # the single forms give the same bits as the combined one
    assert np.array_equal(np.asarray(forms.estimate(q, k, V, draws, None)), out)
    assert np.array_equal(np.asarray(forms.probabilities(q, k, draws, None)), probabilities)
    assert np.array_equal(np.asarray(forms.keys_used(q, k, draws, None)), keys)
    assert np.array_equal(np.asarray(forms.log_denominator(q, k, draws, None)), log_den)
    assert np.asarray(forms.keys_used(q, k, draws, None)).dtype == np.float64


@pytest.mark.parametrize("backend, as_array", BACKENDS, ids=["reference", "batched"])
def test_a_selection_made_once_is_repeated_over_the_replicates(backend, as_array):
    forms = _forms(backend, same_in_every_replicate=True, as_array=as_array)
    q = k = np.zeros((2, 4, 1))
    out, probabilities, keys = (np.asarray(a) for a in forms.estimate_with_probabilities_and_keys_used(
        q, k, V, Draws({}, 3), None))
    assert out.shape == (3, 2, 2) and probabilities.shape == (3, 2, 4) and keys.shape == (3, 2)
    for r in range(3):
        want_out, want_p, want_keys, _ = _written_out(0, 1)
        np.testing.assert_allclose(out[r, 1], want_out, rtol=1e-13, atol=1e-13)
        np.testing.assert_allclose(probabilities[r, 1], want_p, rtol=1e-13, atol=1e-13)
        assert keys[r, 1] == want_keys
    out[0] += 1.0  # a copy per replicate, not a view of one array
    assert not np.array_equal(out[0], out[1])


@pytest.mark.parametrize("form", [vattention.reference.estimate, vattention.batched.keys_used, topk.reference.estimate,
                                  topk.batched.probabilities, magicpig.reference.probabilities,
                                  magicpig.batched.estimate])
def test_a_wrong_keyword_names_the_form_as_its_module_does(form):
    """The forms are methods of one object, but a caller sees module functions: a wrong keyword names ``estimate``,
    not the method's path."""
    name = form.__name__
    assert form.__qualname__ == name
    args = (np.zeros((1, 4)), np.zeros((4, 4)), np.zeros((4, 1)), Draws({}, 1))
    if name in ("keys_used", "probabilities"):
        args = args[:2] + args[3:]
    with pytest.raises(TypeError, match=rf"^{name}\(\): got an unexpected keyword argument 'budgett'$"):
        form(*args, budgett=3)


@pytest.mark.parametrize("family", [vattention, magicpig, topk], ids=lambda f: f.__name__.rsplit(".", 1)[-1])
@pytest.mark.parametrize("side", ["reference", "batched"])
def test_the_values_are_checked_before_anything_is_selected(family, side):
    """The forms check ``v`` with ``q`` and ``k`` (``prepare_reference`` / ``prepare_batched``): a value with NaN,
    or with another number of keys, is refused in words that name it, not met in a matrix product."""
    q, k, v = np.random.default_rng(39).normal(size=(3, 10, 4))
    params = {"vattention": dict(budget="fixed", sinks=1, local=2, top_k=2),
              "magicpig": dict(hash_bits=2, sinks=1, local=2), "topk": {}}[family.__name__.rsplit(".", 1)[-1]]
    draws = family.draw(q.shape, k.shape, num_samples=3, rng=np.random.default_rng(40), **params)
    estimate = getattr(family, side).estimate
    with pytest.raises(ValueError, match="v contains NaN or infinite values"):
        estimate(q, k, np.where(v > 1.5, np.nan, v), draws, **params)
    with pytest.raises(ValueError, match=r"k and v must have the same number of tokens M: k \(10, 4\), v \(5, 4\)"):
        estimate(q, k, v[:5], draws, **params)


def test_the_batched_counts_and_log_denominator_are_float64_in_a_float32_run():
    """``keys_used`` and ``log_denominator`` are float64 whatever the inputs' dtype (the sweep's columns), the
    estimate and probabilities in the inputs' dtype."""
    forms = _forms(sparse_batched, as_array=lambda a: torch.as_tensor(a, dtype=torch.float32))
    q = k = np.zeros((2, 4, 1))
    out, probabilities, keys, log_den = forms.estimate_with_probabilities_keys_used_and_log_denominator(
        q, k, V, Draws({}, 2), None)
    assert (out.dtype, probabilities.dtype, keys.dtype, log_den.dtype) == (torch.float32, torch.float32,
                                                                             torch.float64, torch.float64)
    assert forms.log_denominator(q, k, Draws({}, 2), None).dtype == torch.float64


FAMILIES = {"topk": (topk, {}), "vattention": (vattention, dict(budget="fixed", sinks=1, local=2, top_k=2)),
            "magicpig": (magicpig, dict(hash_bits=2, sinks=1, local=2))}


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("side", ["reference", "batched"])
def test_missing_values_are_refused_not_taken_for_zeros(name, side):
    """Only the forms that read no values (probabilities, keys_used, log_denominator) pass zeros for ``v``; an
    estimate called without values is refused as before the forms were shared."""
    family, params = FAMILIES[name]
    q, k = np.random.default_rng(41).normal(size=(2, 10, 4))
    draws = family.draw(q.shape, k.shape, num_samples=3, rng=np.random.default_rng(42), **params)
    module = getattr(family, side)
    forms = [module.estimate, *(getattr(module, f) for f in ("estimate_with_probabilities",
                                                              "estimate_with_probabilities_and_keys_used")
                                if hasattr(module, f))]
    for form in forms:
        with pytest.raises(TypeError, match="v must be a numpy array or torch tensor"):
            form(q, k, None, draws, **params)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("side", ["reference", "batched"])
def test_the_forms_pickle_by_their_module_names(name, side):
    """A form is its family module's function (``vattention.reference.estimate``), so ``pickle`` (multiprocessing,
    a plain process pool) finds it by that name."""
    import pickle

    module = getattr(FAMILIES[name][0], side)
    for form_name in ("estimate", "probabilities", "keys_used"):
        form = getattr(module, form_name)
        assert form.__module__ == module.__name__
        assert pickle.loads(pickle.dumps(form)) is form


def test_a_selection_made_once_repeats_the_estimate_alone_over_the_replicates():
    """Top-k's ``estimate`` at R = 16 replicates holds one selection's arrays, not R copies of the (N, M)
    probabilities that ``estimate`` throws away: tracemalloc's peak stays below half of the R x N x M float64 bytes
    those copies take (the arrays of one selection, logits, weights, scores, probabilities: about 4 N x M)."""
    import tracemalloc

    rng = np.random.default_rng(43)
    n, m, replicates = 64, 2048, 16
    q, k, v = rng.normal(size=(n, 8)), rng.normal(size=(m, 8)), rng.normal(size=(m, 4))
    draws = topk.draw(q.shape, k.shape, num_samples=32, replicates=replicates)
    topk.reference.estimate(q, k, v, draws)  # warm: imports and caches out of the measurement
    tracemalloc.start()
    try:
        out = topk.reference.estimate(q, k, v, draws)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert out.shape == (replicates, n, 4)
    assert peak < replicates * n * m * 8 / 2, f"peak {peak / 2**20:.1f} MiB"


def test_the_former_kept_keys_methods_warn_and_still_answer():
    """``KeptKeysForms`` had the forms as its methods; they answer through the shared forms, with a warning."""
    from randattn.estimators.sparse.selection import KeptKeysReference
    from randattn.estimators.topk.reference import TopkOptions

    kept = KeptKeysReference(TopkOptions, topk.reference.kept_keys)
    q, k, v = np.random.default_rng(44).normal(size=(3, 10, 4))
    draws = topk.draw(q.shape, k.shape, num_samples=3, replicates=2)
    with pytest.warns(DeprecationWarning, match=r"KeptKeysReference.estimate is deprecated; use the functions that "
                                                r"forms\(\) returns") as caught:
        out = kept.estimate(q, k, v, draws, TopkOptions())
    assert caught[0].filename == __file__
    assert np.array_equal(out, topk.reference.estimate(q, k, v, draws))
    with pytest.raises(AttributeError, match="'KeptKeysReference' object has no attribute 'estimat'"):
        kept.estimat  # noqa: B018
