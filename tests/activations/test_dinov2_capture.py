"""DINOv2 ViT-S/14 capture: the captured q, k, v reproduce the model's own attention output."""

from __future__ import annotations

import numpy as np
import pytest

from randattn.activations.dinov2 import DINOV2_SCALE, capture_dinov2, dinov2_onnx_path, parse_layers
from randattn.activations.images import load_images, preprocess
from randattn.activations.io import load_activations, save_activations

pytest.importorskip("skimage")


def _softmax_attention(q, k, v, scale, dtype):
    """softmax(scale q k^T) v in ``dtype``, with the temperature split as the graph does (q and k each * scale^0.5)."""
    q, k, v = (np.asarray(x, dtype=dtype) for x in (q, k, v))
    root = dtype(np.sqrt(scale))
    logits = (q * root) @ np.swapaxes(k * root, -1, -2)
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return (weights / weights.sum(axis=-1, keepdims=True)) @ v


@pytest.fixture(scope="module")
def astronaut_all_roles(dinov2):
    return dinov2.run(preprocess(load_images("skimage:astronaut"), 196), (0, 3), ("q", "k", "v", "attn"))


@pytest.mark.parametrize("layer", [0, 3], ids=["layer0", "layer3-key-norm-146"])
def test_captured_qkv_reproduce_models_attention_output(astronaut_all_roles, layer, assert_close):
    """softmax(q k^T / 8) v from the capture equals the graph's MatMul_1 output (one image, 197 tokens).

    Tolerance: the model computes in float32, so it is off from the exact (float64) value by float32 rounding.
    We measure that rounding on the same inputs with a float32 numpy evaluation of the same formula and allow 4x
    it (PyTorch's "fused tolerance" rule; ORT's kernels sum in a different order, measured ratio <= 1.3), plus
    8 ulp of the output's magnitude as a floor. A wrong capture (q and k swapped, wrong scale, wrong heads) is off
    by O(1), far outside.
    """
    out = astronaut_all_roles[layer]
    q, k, v, model_out = out["q"], out["k"], out["v"], out["attn"]
    assert q.shape == k.shape == v.shape == model_out.shape == (1, 6, 197, 64)
    exact = _softmax_attention(q, k, v, DINOV2_SCALE, np.float64)
    f32_error = np.abs(_softmax_attention(q, k, v, DINOV2_SCALE, np.float32) - exact).max()
    atol = 4 * f32_error + 8 * np.finfo(np.float32).eps * np.abs(exact).max()
    assert_close(model_out, exact, atol=atol, what=f"layer {layer} attention output")
    # the check has teeth: swapping q and k, or using the scale 1/sqrt(8) instead of 1/8, fails by far
    assert np.abs(_softmax_attention(k, q, v, DINOV2_SCALE, np.float64) - model_out).max() > 1000 * atol
    assert np.abs(_softmax_attention(q, k, v, 8**-0.5, np.float64) - model_out).max() > 1000 * atol


def test_q_k_are_taken_before_the_graphs_scaling(dinov2):
    """The graph multiplies q and k by 64 ** -0.25 after the tensors we capture (inspected, not assumed)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(dinov2.path), load_external_data=False)
    consumers, constants = {}, {}
    for node in model.graph.node:
        if node.op_type == "Constant":
            constants[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    for role, tensor in (("q", "Reshape_2_output_0"), ("k", "Reshape_output_0")):
        (transpose,) = consumers[f"/backbone/encoder/layer.5/attention/attention/{tensor}"]
        assert transpose.op_type == "Transpose", role
        (mul,) = consumers[transpose.output[0]]
        assert mul.op_type == "Mul", role
        assert float(constants[mul.input[1]]) == pytest.approx(64**-0.25, rel=1e-7)


@pytest.mark.parametrize(("size", "tokens"), [(196, 197), (336, 577), (392, 785)])
def test_sizes_give_expected_token_counts(dinov2, size, tokens):
    image = load_images("skimage:coffee")
    out = dinov2.run(preprocess(image, size), (11,))
    assert out[11]["q"].shape == (1, 6, tokens, 64)
    assert np.isfinite(out[11]["q"]).all()


def test_capture_and_file_round_trip(dinov2, tmp_path):
    calls = []
    acts = capture_dinov2("skimage:astronaut,camera", 196, "0,11", model=dinov2,
                          progress=lambda done, total: calls.append((done, total)))
    assert calls == [(1, 2), (2, 2)]
    assert acts.layers == (0, 11) and acts.shape == (2, 6, 197, 64) and acts.scale == 0.125
    assert acts.images == ("skimage:astronaut", "skimage:camera")
    assert acts.metadata["model"] == "dinov2-s14" and acts.metadata["input_size"] == [196, 196]
    assert acts.grid == (14, 14) and acts.prefix_tokens == 1, "CLS then the 196/14 x 196/14 patches"
    # one image at a time gives the same numbers as the batch member
    alone = dinov2.run(preprocess(load_images("skimage:camera"), 196), (11,))[11]["k"][0]
    np.testing.assert_array_equal(acts.k(11)[1], alone)
    back = load_activations(save_activations(acts, tmp_path / "acts.safetensors"))
    assert dict(back.metadata) == dict(acts.metadata)
    for layer in acts.layers:
        for a, b in zip(acts.qkv(layer), back.qkv(layer)):
            np.testing.assert_array_equal(a, b)


def test_checksum_is_verified():
    assert dinov2_onnx_path(verify=True).name == "vit_s_focus.onnx"


@pytest.mark.parametrize(
    ("layers", "expected"),
    [("all", tuple(range(12))), ("0,5,11", (0, 5, 11)), ("11,0,0", (0, 11)), (-1, (11,)), ([3], (3,))],
)
def test_parse_layers(layers, expected):
    assert parse_layers(layers) == expected


@pytest.mark.parametrize(
    ("layers", "message"),
    [("12", r"layer 12 is out of range; the model has layers 0\.\.11"), ("a,b", "comma-separated ints"),
     (",", "selects no layer")],
)
def test_parse_layers_rejects(layers, message):
    with pytest.raises(ValueError, match=message):
        parse_layers(layers)


def test_capture_rejects_bad_size(dinov2):
    with pytest.raises(ValueError, match=r"size must be a positive multiple of 14 \(e\.g\. 196, 336, 392\), got 200"):
        capture_dinov2("skimage:astronaut", 200, model=dinov2)
