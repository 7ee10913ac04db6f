"""Activation files: round trips in every container, atomic writes, and validation with clear messages."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from randattn.activations.io import Activations, load_activations, make_activations, save_activations


def _acts(layers=(0, 3), shape=(2, 3, 5, 4), seed=0) -> Activations:
    rng = np.random.default_rng(seed)
    arrays = {layer: tuple(rng.standard_normal(shape).astype(np.float32) for _ in range(3)) for layer in layers}
    meta = {"model": "toy", "scale": 0.5, "images": [f"img{i}" for i in range(shape[0])], "source": "test"}
    return make_activations(arrays, meta)


@pytest.mark.parametrize("suffix", [".safetensors", ".npz", ".pt"])
def test_round_trip_is_identical(tmp_path, suffix):
    acts = _acts()
    path = save_activations(acts, tmp_path / f"a{suffix}")
    back = load_activations(path)
    assert back.layers == (0, 3)
    assert back.scale == 0.5
    assert back.shape == (2, 3, 5, 4)
    assert dict(back.metadata) == dict(acts.metadata)
    for layer in acts.layers:
        for a, b in zip(acts.qkv(layer), back.qkv(layer)):
            assert b.dtype == np.float32
            np.testing.assert_array_equal(a, b)


def test_float16_storage_and_overflow(tmp_path):
    acts = _acts()
    back = load_activations(save_activations(acts, tmp_path / "h.safetensors", dtype="float16"))
    assert back.q(0).dtype == np.float16 and back.metadata["dtype"] == "float16"
    np.testing.assert_array_equal(back.q(0), acts.q(0).astype(np.float16))
    big = make_activations({0: (np.full((1, 1, 2, 2), 1e6), np.ones((1, 1, 2, 2)), np.ones((1, 1, 2, 2)))},
                           {"scale": 1.0})
    with pytest.raises(ValueError, match=r"layer0\.q overflows float16"):
        save_activations(big, tmp_path / "big.safetensors", dtype="float16")
    assert not (tmp_path / "big.safetensors").exists()


def test_arrays_are_read_only():
    acts = _acts()
    with pytest.raises(ValueError, match="read-only"):
        acts.q(0)[0, 0, 0, 0] = 1.0
    with pytest.raises(KeyError, match=r"layer 7 is not in these activations \(layers: \[0, 3\]\)"):
        acts.q(7)


def test_interrupted_write_leaves_old_file_and_no_temp(tmp_path, monkeypatch):
    path = save_activations(_acts(seed=1), tmp_path / "a.safetensors")
    before = path.read_bytes()

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(KeyboardInterrupt):
        save_activations(_acts(seed=2), path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors"]


def _write_npz(path, arrays, meta):
    extra = {} if meta is None else {"__metadata__": np.array(json.dumps(meta))}
    np.savez(path, **arrays, **extra)
    return path


def _good(shape=(1, 2, 3, 4)):
    return {f"layer{L}.{r}": np.ones(shape, np.float32) for L in (0, 1) for r in "qkv"}


def test_user_npz_and_pt_with_minimal_metadata(tmp_path):
    npz = load_activations(_write_npz(tmp_path / "u.npz", _good(), {"scale": 0.125}))
    assert npz.metadata["images"] == ["image0"] and npz.metadata["layers"] == [0, 1]
    assert npz.metadata["heads"] == 2 and npz.metadata["tokens"] == 3 and npz.metadata["head_dim"] == 4
    pt = tmp_path / "u.pt"
    torch.save({**{k: torch.from_numpy(v) for k, v in _good().items()}, "__metadata__": '{"scale": 0.125}'}, pt)
    assert load_activations(pt).scale == 0.125


def test_missing_file():
    with pytest.raises(FileNotFoundError, match="activation file not found: 'nope.safetensors'"):
        load_activations("nope.safetensors")


def test_unknown_suffix_and_unreadable(tmp_path):
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(ValueError, match=r"unknown suffix '\.txt'"):
        load_activations(tmp_path / "x.txt")
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="cannot read as safetensors"):
        load_activations(tmp_path / "bad.safetensors")
    (tmp_path / "bad.npz").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="cannot read as npz") as info:
        load_activations(tmp_path / "bad.npz")
    # said as what it is, not numpy's advice to unpickle it (np.load takes a non-zip file for a pickle)
    assert "not an .npz archive" in str(info.value) and "allow_pickle" not in str(info.value)


@pytest.mark.parametrize(
    ("mutate", "meta", "message"),
    [
        (lambda a: a.pop("layer1.k"), {"scale": 1.0}, r"missing key\(s\) \['layer1\.k'\] for layer 1"),
        (lambda a: a.update({"layer0.Q": a["layer0.q"]}), {"scale": 1.0}, r"unexpected key 'layer0\.Q'"),
        (lambda a: a.update({"layer0.v": np.ones((1, 2, 3, 5), np.float32)}), {"scale": 1.0},
         r"layer0\.v has shape \(1, 2, 3, 5\) but layer0\.q has shape \(1, 2, 3, 4\)"),
        (lambda a: a.update({"layer1.q": np.ones((1, 2, 7, 4), np.float32)}), {"scale": 1.0},
         r"layer1\.q has shape \(1, 2, 7, 4\) but layer0\.q"),
        (lambda a: a.update({"layer0.q": np.ones((2, 3, 4), np.float32)}), {"scale": 1.0},
         r"layer0\.q has shape \(2, 3, 4\); expected 4 dims"),
        (lambda a: a["layer1.v"].__setitem__((0, 0, 0, 0), np.nan), {"scale": 1.0},
         r"layer1\.v holds 1 non-finite value"),
        (lambda a: a.update({"layer0.k": np.ones((1, 2, 3, 4), np.int32)}), {"scale": 1.0},
         r"layer0\.k has dtype int32"),
        (lambda a: None, {"scale": 0.0}, r"'scale' must be positive and finite, got 0\.0"),
        (lambda a: None, {"scale": -1}, r"'scale' must be positive"),
        (lambda a: None, {"scale": "big"}, r"'scale' must be a number, got 'big'"),
        (lambda a: None, {"model": "x"}, r"metadata has no 'scale'"),
        (lambda a: None, {"scale": 1.0, "heads": 6}, r"metadata 'heads' is 6 but the arrays give 2"),
        (lambda a: None, {"scale": 1.0, "images": ["a", "b"]}, r"'images' must list 1 name"),
        (lambda a: None, None, r"no metadata found"),
    ],
    ids=["missing-key", "unexpected-key", "qkv-shape", "layer-shape", "ndim", "nan", "int-dtype", "scale-zero",
         "scale-negative", "scale-text", "no-scale", "heads-disagree", "image-names", "no-metadata"],
)
def test_bad_files_raise_naming_the_problem(tmp_path, mutate, meta, message):
    arrays = _good()
    mutate(arrays)
    path = _write_npz(tmp_path / "bad.npz", arrays, meta)
    with pytest.raises(ValueError, match=message) as info:
        load_activations(path)
    assert str(path) in str(info.value)


def test_bad_json_and_save_arguments(tmp_path):
    np.savez(tmp_path / "j.npz", **_good(), __metadata__=np.array("{not json"))
    with pytest.raises(ValueError, match="metadata is not valid JSON"):
        load_activations(tmp_path / "j.npz")
    with pytest.raises(ValueError, match=r"dtype must be one of \['float16', 'float32'\] or None, got 'int8'"):
        save_activations(_acts(), tmp_path / "a.safetensors", dtype="int8")
    with pytest.raises(ValueError, match=r"path: unknown suffix '\.h5'"):
        save_activations(_acts(), tmp_path / "a.h5")
    with pytest.raises(TypeError, match="acts must be an Activations, got dict"):
        save_activations({}, tmp_path / "a.safetensors")


def _pt_file(tmp_path, tensors, name="acts.pt"):
    import json

    import torch

    path = tmp_path / name
    torch.save({**tensors, "__metadata__": json.dumps({"scale": 0.25})}, path)
    return path


def test_pt_bfloat16_is_upcast_exactly(tmp_path):
    import torch

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=g).to(torch.bfloat16) for _ in range(3))
    acts = load_activations(_pt_file(tmp_path, {"layer0.q": q, "layer0.k": k, "layer0.v": v}))
    np.testing.assert_array_equal(acts.q(0), q.float().numpy())  # bfloat16 -> float32 is exact
    assert acts.q(0).dtype == np.float32


def test_pt_with_pickled_code_is_refused_in_one_clean_line(tmp_path):
    import torch

    path = tmp_path / "evil.pt"
    torch.save({"layer0.q": torch.zeros(1, 1, 2, 2), "hook": print}, path)
    with pytest.raises(ValueError) as info:
        load_activations(path)
    message = str(info.value)
    assert "evil.pt" in message and "weights_only=True" in message
    assert "\n" not in message and "\x1b" not in message  # one line, no ANSI escapes


def test_a_results_table_given_as_activations_is_named_as_such(tmp_path):
    """``randattn mse d1.parquet`` (a results table) said "path: unknown suffix": the message names the activation
    file, what activations are, and where a results table goes; another suffix gets no such hint."""
    for name, hint in (("d1.parquet", True), ("acts.h5", False)):
        (tmp_path / name).write_bytes(b"x")
        with pytest.raises(ValueError) as info:
            load_activations(tmp_path / name)
        message = str(info.value)
        assert message.startswith(f"activation file {str(tmp_path / name)!r}: unknown suffix ")
        assert ("a results table: randattn report and randattn plot read it" in message) is hint
        assert "activations are one of [" in message and "path:" not in message
