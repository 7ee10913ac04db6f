"""The Mask value (randattn.estimators.masks.Mask): parsing, names, estimator keywords and visibility.

Visibility is checked against a double loop over (query n, key m) written here from the rule of ARCHITECTURE sec. 12
(key m visible to query n iff m <= n + M - N; under a sliding window of W keys also m > n + M - N - W), never
against the functions under test.
"""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch

from randattn.estimators.masks import DECLARABLE_MASKS, MASK_KINDS, MASKS, NO_MASK, Mask, check_mask_argument

SHAPES = [(1, 1), (1, 6), (4, 4), (5, 5), (3, 7), (7, 7), (2, 9)]
STRINGS = [None, "none", "causal", "sliding:1", "sliding:3", "sliding:12"]


def _visible_by_loop(text: str | None, n: int, m: int) -> np.ndarray:
    """(N, M) visibility from the rule, element by element."""
    visible = np.zeros((n, m), dtype=bool)
    window = int(text.split(":")[1]) if text is not None and text.startswith("sliding:") else None
    for i in range(n):
        last = i + m - n  # the query's own position among the M tokens (queries are the last N)
        for j in range(m):
            if text in (None, "none"):
                visible[i, j] = True
            else:
                visible[i, j] = j <= last and (window is None or j > last - window)
    return visible


@pytest.mark.parametrize("text", STRINGS, ids=lambda t: str(t))
def test_parse_gives_the_kind_label_and_estimator_keywords(text):
    mask = Mask.parse(text)
    expected_label = "none" if text is None else text
    assert mask.label == expected_label
    assert mask.kind == (None if expected_label == "none" else expected_label)
    assert mask.masked == (expected_label != "none")
    assert mask.estimator_kwargs == ({} if expected_label == "none" else {"mask": expected_label})
    assert mask.name in MASK_KINDS
    assert Mask.parse(mask.label) == mask and Mask.parse(mask.kind) == mask  # the names read back
    assert Mask.parse(mask) is mask


def test_constructors_and_equality():
    assert Mask() == Mask.parse(None) == Mask("none") == NO_MASK and not NO_MASK.masked
    assert Mask("causal") == Mask.parse("causal") != Mask()
    assert Mask("sliding", 4) == Mask.parse("sliding:4") != Mask("sliding", 5)
    assert Mask("sliding", np.int64(4)).window == 4 and type(Mask("sliding", np.int64(4)).window) is int
    assert len({Mask(), Mask("causal"), Mask.parse("causal"), Mask("sliding", 2)}) == 3  # hashable, by value
    with pytest.raises(AttributeError):
        Mask().name = "causal"  # frozen


def test_estimator_keywords_are_a_new_dict_each_time():
    mask = Mask("causal")
    mask.estimator_kwargs["mask"] = "junk"
    assert mask.estimator_kwargs == {"mask": "causal"}


def test_every_estimator_mask_is_a_mask_kind():
    assert [Mask.parse(m).kind for m in MASKS] == list(MASKS)


@pytest.mark.parametrize("text", STRINGS, ids=lambda t: str(t))
@pytest.mark.parametrize("n,m", SHAPES, ids=lambda s: str(s))
def test_visibility_and_counts_match_a_loop(text, n, m):
    mask = Mask.parse(text)
    expected = _visible_by_loop(text, n, m)
    visible = mask.visible(n, m)
    if mask.masked:
        assert visible.dtype == bool and np.array_equal(visible, expected)
    else:
        assert visible is None and expected.all()
    counts = mask.visible_counts(n, m)
    assert counts.dtype == np.int64
    assert counts.tolist() == [int(row.sum()) for row in expected]
    tensor = mask.visible_tensor(n, m)
    if mask.masked:
        assert tensor.dtype == torch.bool and np.array_equal(tensor.numpy(), expected)
    else:
        assert tensor is None
    assert mask.first_visible_key(n, m) == int(np.flatnonzero(expected.any(axis=0))[0])


@pytest.mark.parametrize(("mask", "declared", "allowed"), [
    (None, MASKS, True), ("causal", MASKS, True), ("sliding:3", MASKS, False), ("sliding:3", DECLARABLE_MASKS, True),
    ("causal", (None,), False), ("none", DECLARABLE_MASKS, False), ("sliding", DECLARABLE_MASKS, False),
    ("sliding:0", DECLARABLE_MASKS, False), (3, DECLARABLE_MASKS, False), (Mask("causal"), MASKS, False),
], ids=repr)
def test_an_estimators_mask_argument_is_one_it_declares(mask, declared, allowed):
    """None, 'causal', or 'sliding:W' where 'sliding' is declared; a table label ('none'), the bare family name
    ('sliding') and a Mask object are not an estimator's keyword."""
    if allowed:
        assert check_mask_argument(mask, declared) == mask
        return
    with pytest.raises(ValueError, match=re.escape(f"mask={mask!r} is not allowed; choose one of ")) as info:
        check_mask_argument(mask, declared)
    assert ("'sliding:W' (W a positive integer)" in str(info.value)) == ("sliding" in declared)


@pytest.mark.parametrize("text", [None, "causal", "sliding:3"], ids=str)
def test_the_deprecated_analysis_helpers_warn_and_give_the_masks_answers(text):
    from randattn.analysis import masking

    mask = Mask.parse(text)
    assert masking.parse_mask_kind(text) == mask.kind  # the stored form, not deprecated

    def deprecated(name, replacement, *args):
        with pytest.warns(DeprecationWarning) as caught:
            value = getattr(masking, name)(*args)
        assert len(caught) == 1 and caught[0].filename == __file__  # points at the caller
        assert str(caught[0].message) == (f"randattn.analysis.masking.{name} is deprecated; use {replacement} "
                                          "(randattn.estimators.masks.Mask)")
        return value

    assert deprecated("mask_label", "Mask.parse(kind).label", mask.kind) == mask.label
    assert deprecated("estimator_mask_kwargs", "Mask.parse(kind).estimator_kwargs", mask.kind) == mask.estimator_kwargs
    assert deprecated("sliding_window", "Mask.parse(kind).window", mask.kind) == mask.window
    counts = deprecated("visible_key_counts", "Mask.parse(kind).visible_counts(num_queries, num_keys)", mask.kind, 3, 7)
    assert np.array_equal(counts, mask.visible_counts(3, 7))
    visible = deprecated("visible_keys", "Mask.parse(kind).visible(num_queries, num_keys)", mask.kind, 3, 7)
    assert (visible is None) if not mask.masked else np.array_equal(visible, mask.visible(3, 7))


def test_the_cli_offers_the_estimator_masks_and_the_file():
    from randattn.analysis.masking import MASK_CHOICES

    assert MASK_CHOICES == ("none", "causal", "file")


@pytest.mark.parametrize("bad", ["diagonal", "causal ", "sliding", "Causal", "", 3, True, ("causal",)], ids=repr)
def test_bad_strings_are_refused_naming_the_choices(bad):
    with pytest.raises(ValueError) as info:
        Mask.parse(bad, where="mask of layer 3")
    assert str(info.value) == (f"mask of layer 3 {bad!r} is not a mask kind; use 'none' (bidirectional), 'causal' or "
                               "'sliding:W' (W a positive integer)")


@pytest.mark.parametrize("bad", ["sliding:0", "sliding:-2", "sliding:2.5", "sliding:02", "sliding:+4", "sliding:",
                                 "sliding:abc"])
def test_a_sliding_mask_without_a_window_is_refused_naming_the_window(bad):
    with pytest.raises(ValueError) as info:
        Mask.parse(bad, where="--mask")
    assert str(info.value) == (f"--mask {bad!r}: the window W of 'sliding:W' must be a positive integer written "
                               "without sign or leading zeros, as sliding:4096")


def test_bad_fields_are_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"Mask name 'window' is not a mask kind; choose one of 'none', 'causal', "
                                         r"'sliding'"):
        Mask("window")
    with pytest.raises(ValueError, match=r"Mask 'causal' takes no window, got window=3"):
        Mask("causal", 3)
    with pytest.raises(TypeError, match=r"Mask 'sliding' needs window W, a positive integer, got None"):
        Mask("sliding")
    with pytest.raises(TypeError, match=r"got True"):
        Mask("sliding", True)
    with pytest.raises(ValueError, match=r"window W >= 1, got window=0"):
        Mask("sliding", 0)


@pytest.mark.parametrize("text", ["causal", "sliding:2"])
def test_masked_visibility_needs_as_many_keys_as_queries(text):
    mask = Mask.parse(text)
    for method in (mask.visible, mask.visible_counts):
        with pytest.raises(ValueError, match="N=4 queries and M=3 keys"):
            method(4, 3)
    assert Mask().visible_counts(4, 3).tolist() == [3, 3, 3, 3]  # no mask: any shapes


def test_parsing_warns_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Mask.parse("sliding:7").visible(2, 9)
