"""Hugging Face capture: on tiny random-init models saved with save_pretrained and loaded back (no download),
the captured q, k, v and scale reproduce each attention module's own output, and the grid metadata counts tokens."""

from __future__ import annotations

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from randattn.activations.hf import (  # noqa: E402
    attention_modules,
    capture_hf,
    capture_hf_attention,
    hf_preprocessing,
    load_hf_model,
)

_TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=32,
             patch_size=8)
#: name -> (config class, model class, extra config, prefix tokens: CLS + distillation + registers)
ARCHITECTURES = {
    "vit": ("ViTConfig", "ViTModel", {}, 1),
    "deit": ("DeiTConfig", "DeiTModel", {}, 2),
    "dinov2": ("Dinov2Config", "Dinov2Model", {}, 1),
    "dinov2-registers": ("Dinov2WithRegistersConfig", "Dinov2WithRegistersModel", {"num_register_tokens": 3}, 4),
    "clip-vision": ("CLIPVisionConfig", "CLIPVisionModel", {}, 1),
    "siglip-vision": ("SiglipVisionConfig", "SiglipVisionModel", {}, 0),  # no CLS token
}


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def saved_model(request, tmp_path_factory):
    config_cls, model_cls, extra, prefix = ARCHITECTURES[request.param]
    torch.manual_seed(0)  # only the random init of the weights
    config = getattr(transformers, config_cls)(**_TINY, **extra)
    model = getattr(transformers, model_cls)(config).eval()
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    return request.param, folder, prefix, load_hf_model(folder, local_files_only=True)


def _exact_attention(q, k, v, scale):
    """softmax(scale q k^T) v in float64, written out independently of the package."""
    logits = scale * q @ np.swapaxes(k, -1, -2)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    return (w / w.sum(-1, keepdims=True)) @ v


@pytest.mark.parametrize("size", [32, 48], ids=["train-size", "interpolated"])
def test_captured_qkv_reproduce_the_models_attention(saved_model, size, assert_close):
    name, folder, prefix, model = saved_model
    assert len(attention_modules(model)) == 2
    pixels = np.random.default_rng(0).standard_normal((2, 3, size, size)).astype(np.float32)
    out = capture_hf_attention(model, pixels, "all", attention_output=True)
    grid = size // 8
    for layer in (0, 1):
        q, k, v, attn = (out[layer][r].astype(np.float64) for r in ("q", "k", "v", "attn"))
        assert q.shape == (2, 4, prefix + grid * grid, 8)
        assert out["scale"][layer] == 8**-0.5
        exact = _exact_attention(q, k, v, out["scale"][layer])
        # float32 model vs float64 recomputation of small logits (|l| < ~5, D = 8): float32 rounding stays
        # below ~1e-6 relative; 1e-5 bounds it with margin, while a wrong scale or a swapped q/k is O(0.1) off
        assert_close(attn, exact, atol=1e-5 * max(1.0, np.abs(exact).max()), what=f"{name} layer {layer}")
        # the check has teeth: the same q, k, v with a scale 10% off do not reproduce the output
        wrong = _exact_attention(q, k, v, 1.1 * out["scale"][layer])
        assert np.abs(wrong - attn).max() > 1e-4


def test_capture_metadata_grid_and_prefix(saved_model):
    name, folder, prefix, model = saved_model
    acts = capture_hf(model, "skimage:astronaut", 32, "1", name=str(folder),
                      preprocessing=hf_preprocessing(folder, model.config))
    meta = acts.metadata
    assert acts.shape == (1, 4, prefix + 16, 8) and acts.layers == (1,)
    assert meta["grid"] == [4, 4] and meta["prefix_tokens"] == prefix
    assert meta["tokens"] == meta["prefix_tokens"] + meta["grid"][0] * meta["grid"][1]
    assert meta["model"] == f"hf:{folder}" and meta["scale"] == 8**-0.5


def test_hooks_are_removed(saved_model):
    model = saved_model[-1]
    capture_hf_attention(model, np.zeros((1, 3, 32, 32), np.float32), [0], attention_output=True)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_clip_full_model_uses_its_vision_tower(tmp_path):
    torch.manual_seed(0)
    config = transformers.CLIPConfig(
        vision_config={**_TINY}, text_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                                  intermediate_size=64, vocab_size=99),
        projection_dim=16,
    )
    transformers.CLIPModel(config).save_pretrained(tmp_path)
    model = load_hf_model(tmp_path, local_files_only=True)
    assert len(attention_modules(model)) == 2  # the text tower's single layer is not among them
    out = capture_hf_attention(model, np.zeros((1, 3, 32, 32), np.float32), "all")
    assert out[0]["q"].shape == (1, 4, 17, 8)


def test_unsupported_and_missing_models(tmp_path):
    transformers.BeitModel(transformers.BeitConfig(**_TINY)).save_pretrained(tmp_path / "beit")
    with pytest.raises(ValueError, match="'beit' model; the HF capture supports model types vit, deit"):
        load_hf_model(tmp_path / "beit", local_files_only=True)
    with pytest.raises(ValueError, match="cannot load a transformers config from"):
        load_hf_model(tmp_path / "nothing-here", local_files_only=True)


def test_preprocessing_from_the_checkpoint_or_defaults(tmp_path):
    import json

    (tmp_path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "ViTImageProcessor", "image_mean": [0.5, 0.5, 0.5], "image_std": [0.25, 0.5, 0.5],
        "size": {"height": 48, "width": 48}}))
    found = hf_preprocessing(tmp_path)
    assert (found["mean"], found["std"], found["size"]) == ((0.5, 0.5, 0.5), (0.25, 0.5, 0.5), 48)
    (tmp_path / "preprocessor_config.json").unlink()
    assert hf_preprocessing(tmp_path)["mean"] == (0.485, 0.456, 0.406)  # ImageNet when the folder has none
