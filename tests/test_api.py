"""randattn.estimate: one call, same draws whichever backend, seeds as ints or Generators."""

from __future__ import annotations


import numpy as np
import pytest
import torch

import randattn
import randattn.api
from randattn.testing import assert_close


@pytest.fixture
def qkv():
    rng = np.random.default_rng(0)
    return rng.standard_normal((2, 10, 6)), rng.standard_normal((2, 12, 6)), rng.standard_normal((2, 12, 4))


def test_reference_returns_numpy_and_torch_returns_tensor_on_device(qkv):
    q, k, v = qkv
    ref = randattn.estimate("rfa", q, k, v, num_samples=16, seed=1)
    bat = randattn.estimate("rfa", q, k, v, num_samples=16, seed=1, backend="torch", device="cpu")
    assert isinstance(ref, np.ndarray) and ref.dtype == np.float64 and ref.shape == (2, 10, 4)
    assert isinstance(bat, torch.Tensor) and bat.dtype == torch.float32 and bat.device.type == "cpu"


def test_seed_as_generator_gives_the_same_draws_as_the_int(qkv):
    q, k, v = qkv
    a = randattn.estimate("ra", q, k, v, num_samples=3, seed=5)
    b = randattn.estimate("ra", q, k, v, num_samples=3, seed=np.random.default_rng(5))
    assert np.array_equal(a, b)


def test_torch_inputs_work_with_the_reference_backend(qkv):
    q, k, v = qkv
    from_numpy = randattn.estimate("rfa", q, k, v, num_samples=8, seed=2)
    from_torch = randattn.estimate("rfa", *(torch.tensor(a) for a in qkv), num_samples=8, seed=2)
    assert_close(from_torch, from_numpy, atol=0)


def test_same_seed_same_draws_across_backends_so_a_run_is_checkable_by_its_seed(qkv):
    """float32 torch vs float64 reference from nothing but the seed: equal to float32 precision."""
    q, k, v = qkv
    ref = randattn.estimate("rfa", q, k, v, num_samples=32, seed=9, replicates=2, feature_map="hyperbolic")
    bat = randattn.estimate("rfa", q, k, v, num_samples=32, seed=9, replicates=2, feature_map="hyperbolic", backend="torch")
    assert_close(bat, ref, atol=5e-5, rtol=5e-5)


def test_default_scale_is_inverse_sqrt_head_dim(qkv):
    q, k, v = qkv
    assert_close(randattn.estimate("softmax", q, k, v), randattn.estimate("softmax", q, k, v, scale=6**-0.5), atol=0)


def test_bool_seed_is_rejected(qkv):
    with pytest.raises(TypeError, match="seed must be"):
        randattn.estimate("rfa", *qkv, num_samples=2, seed=True)


def test_catalogue_lists_every_estimator_with_parameters():
    records = {r["name"]: r for r in randattn.catalogue()}
    assert {"softmax", "rfa", "ra"} <= set(records)
    assert records["rfa"]["parameters"]["feature_map"]["choices"] == ["positive", "hyperbolic", "trigonometric", "regularized", "oprf", "sderf"]
    assert records["softmax"]["random"] is False and records["rfa"]["random"] is True


def test_an_option_named_k_is_an_option_not_the_keys(qkv):
    """q, k and v are positional-only: ``k=4`` on top-k reaches the options and is refused as one, naming S, where
    Python used to say 'got multiple values for argument k'."""
    q, k, v = qkv
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) 'k' for estimator 'topk'.*is num_samples; "
                                         r"q, k and v are the input arrays, given by position$"):
        randattn.estimate("topk", q, k, v, k=4)
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) 'v' for estimator 'softmax'.*q, k and v are the "):
        randattn.estimate("softmax", q, k, v, v=v)  # given twice: the keyword is read as an option


def test_naming_q_k_v_as_keywords_is_deprecated_and_gives_the_same_numbers(qkv):
    q, k, v = qkv
    expected = randattn.estimate("rfa", q, k, v, num_samples=8, seed=3)
    with pytest.warns(DeprecationWarning, match=r"passing name, q, k, v by keyword is deprecated") as caught:
        got = randattn.estimate(name="rfa", q=q, k=k, v=v, num_samples=8, seed=3)
    assert caught[0].filename == __file__  # the warning points at the caller's line
    np.testing.assert_array_equal(got, expected)
    with pytest.warns(DeprecationWarning, match=r"passing v by keyword"):
        np.testing.assert_array_equal(randattn.estimate("rfa", q, k, v=v, num_samples=8, seed=3), expected)


def test_a_missing_argument_is_named_and_the_signature_reads_positional_only(qkv):
    import inspect

    q, k, _ = qkv
    with pytest.raises(TypeError, match=r"estimate\(\) missing v: call estimate\(name, q, k, v, \.\.\.\)"):
        randattn.estimate("rfa", q, k, num_samples=8)
    parameters = list(inspect.signature(randattn.estimate).parameters.values())[:4]
    assert [(p.name, p.kind, p.default) for p in parameters] == [
        (name, inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.empty) for name in ("name", "q", "k", "v")]


def test_read_only_arrays_from_the_loader_give_no_torch_warning(tmp_path):
    """Activations.qkv gives read-only arrays; the torch backend shares them (the estimators never write their
    inputs) without torch's "not writable" warning, and gives what writable copies give."""
    import warnings

    q, k, v = (np.random.default_rng(3).normal(size=(2, 6, 4)) for _ in range(3))
    frozen = [a.copy() for a in (q, k, v)]
    for a in frozen:
        a.setflags(write=False)
    expected = randattn.estimate("softmax", q, k, v, backend="torch", mask="causal")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = randattn.estimate("softmax", *frozen, backend="torch", mask="causal")
    assert torch.equal(got, expected)


def test_stored_grouped_query_heads_are_named_as_such():
    """A capture of a grouped-query model stores 2 key/value heads for 8 query heads; passing them as they are said
    only that the batch dims differ. The message now says what the shapes look like and where the gathered k, v
    come from; other mismatches (3 query heads over 2) are not called grouped."""
    q, kv = np.zeros((1, 8, 5, 4)), np.zeros((1, 2, 5, 4))
    with pytest.raises(ValueError, match=r"8 query heads over 2 key/value heads looks like grouped-query attention"
                                         r".*Activations\.qkv\(layer\)"):
        randattn.estimate("softmax", q, kv, kv)
    with pytest.raises(ValueError, match=r"same batch dims: q \(1, 3, 5, 4\), k \(1, 2, 5, 4\), v \(1, 2, 5, 4\)$"):
        randattn.estimate("softmax", np.zeros((1, 3, 5, 4)), kv, kv)
    with pytest.raises(ValueError, match=r"same batch dims: q \(1, 8, 5, 4\), k \(1, 8, 5, 4\), v \(1, 2, 5, 4\)$"):
        randattn.estimate("softmax", q, q, kv)  # v alone differs: not a grouping of the query heads
    with pytest.raises(ValueError, match=r"v \(1, 4, 5, 4\)$"):
        randattn.estimate("softmax", q, kv, np.zeros((1, 4, 5, 4)))  # k and v disagree with each other
    with pytest.raises(ValueError, match=r"v \(1, 2, 5, 4\)$"):
        randattn.estimate("softmax", np.zeros((1, 0, 5, 4)), kv, kv)  # no query heads to group


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_is_refused_by_name(qkv, dtype):
    """bfloat16 reached top-k's selection and failed inside torch (``Got unsupported ScalarType``); float16 ran,
    with a budget of 2,049 keys rounded to 2,048 (its significand has 11 bits). Both are refused before anything
    runs; float32 and float64 are what the docs promise."""
    import torch

    q, k, v = qkv
    with pytest.raises(ValueError, match=rf"dtype must be torch.float32 or torch.float64, got torch.{dtype}"):
        randattn.estimate("topk", q, k, v, num_samples=4, backend="torch", dtype=getattr(torch, dtype))


def test_a_negative_seed_and_a_text_scale_are_named():
    """numpy's own 'expected non-negative integer' came from twelve frames down, naming no argument; a scale given as
    text passed as a number."""
    q, k, v = np.random.default_rng(2).normal(size=(3, 2, 16, 8))
    for call in (lambda: randattn.estimate("softmax", q, k, v, seed=-1),
                 lambda: randattn.draw("rfa", (2, 16, 8), (2, 16, 8), num_samples=4, seed=-1)):
        with pytest.raises(ValueError, match=r"seed must be a non-negative int .* got -1"):
            call()
    with pytest.raises(TypeError, match=r"scale must be a positive real number, got '0.1'"):
        randattn.estimate("softmax", q, k, v, scale="0.1")


def test_mask_none_is_no_mask_as_the_messages_spell_it():
    """A refusal lists what an estimator supports as ``none, 'causal'`` (the command line's spelling), but
    ``mask="none"`` was an unknown mask."""
    q, k, v = np.random.default_rng(2).normal(size=(3, 2, 16, 8))
    np.testing.assert_array_equal(randattn.estimate("softmax", q, k, v, mask="none"),
                                  randattn.estimate("softmax", q, k, v))
    with pytest.raises(ValueError, match=r"\(it supports: none, 'causal'\)"):
        randattn.estimate("rfa", q, k, v, num_samples=8, mask="sliding:8")


@pytest.mark.parametrize("mask", ["sideways", 3, b"causal"])
def test_a_mask_naming_nothing_is_told_the_api_spellings_none_among_them(mask):
    """``mask="none"`` is accepted, so the refusal of a value that names no mask lists it; the spec's own check
    said ``None (bidirectional)`` only."""
    q, k, v = np.random.default_rng(2).normal(size=(3, 2, 16, 8))
    for call in (lambda: randattn.estimate("softmax", q, k, v, mask=mask),
                 lambda: randattn.draw("rfa", q.shape, k.shape, num_samples=4, mask=mask)):
        with pytest.raises(ValueError, match=r"is not a mask kind; use 'none' \(bidirectional\), 'causal' or "):
            call()
