"""Hook-based capture from timm-style ViTs: captured q, k, v reproduce each attention module's output."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from randattn.activations.torch_vit import attention_modules, capture_torch_attention


class TimmStyleAttention(nn.Module):
    """The interface timm's ``Attention`` has (fused qkv, num_heads, scale, q_norm/k_norm, proj), unfused math."""

    def __init__(self, dim: int, num_heads: int, qk_norm: bool) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, 3 * dim)
        self.q_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        x = torch.softmax(q * self.scale @ k.transpose(-2, -1), dim=-1) @ v
        return self.proj(x.transpose(1, 2).reshape(b, n, c))


class TinyViT(nn.Module):
    def __init__(self, dim=24, heads=3, depth=2, patch=8, qk_norm=False):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, patch)
        self.cls = nn.Parameter(torch.randn(1, 1, dim))
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"norm": nn.LayerNorm(dim), "attn": TimmStyleAttention(dim, heads, qk_norm)})
            for _ in range(depth)
        )

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1)
        for block in self.blocks:
            x = x + block["attn"](block["norm"](x))
        return x


def _check_equality(model, size, assert_close):
    torch.manual_seed(0)  # only the model's init; inputs come from a numpy Generator
    pixels = np.random.default_rng(0).standard_normal((2, 3, size, size)).astype(np.float32)
    out = capture_torch_attention(model, pixels, "all", attention_output=True)
    layers = sorted(k for k in out if k != "scale")
    assert layers == list(range(len(attention_modules(model))))
    for layer in layers:
        q, k, v, attn = (out[layer][r].astype(np.float64) for r in ("q", "k", "v", "attn"))
        scale = out["scale"][layer]
        logits = scale * q @ np.swapaxes(k, -1, -2)
        w = np.exp(logits - logits.max(-1, keepdims=True))
        exact = (w / w.sum(-1, keepdims=True)) @ v
        # float32 model vs float64 recomputation: tiny logits (|l| < ~5) and D <= 64 keep the float32 rounding
        # below ~1e-6 relative; 1e-5 (about 80 ulp of float32) bounds it with margin, a wrong capture is O(1) off
        assert_close(attn, exact, atol=1e-5 * max(1.0, np.abs(exact).max()), what=f"layer {layer}")
    return out


@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk-norm"])
def test_hooks_on_timm_style_modules(qk_norm, assert_close):
    torch.manual_seed(0)
    model = TinyViT(qk_norm=qk_norm).eval()
    out = _check_equality(model, 32, assert_close)
    assert out[0]["q"].shape == (2, 3, 17, 8)
    if qk_norm:  # the captured q is the normalised one (zero mean over head_dim after LayerNorm)
        np.testing.assert_allclose(out[1]["q"].mean(-1), 0.0, atol=1e-5)


def test_hooks_are_removed():
    model = TinyViT().eval()
    capture_torch_attention(model, np.zeros((1, 3, 16, 16), np.float32), [1])
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


@pytest.fixture
def timm_module(monkeypatch):
    """timm, importing beside a torchvision stub when the real one is absent or broken
    (see torchvision_stub.py); every module imported here is removed again afterwards."""
    import importlib
    import importlib.util
    import sys

    if importlib.util.find_spec("timm") is None:
        pytest.skip("timm is not installed (pip install --no-deps timm)")
    before = set(sys.modules)
    try:
        import torchvision  # noqa: F401
    except Exception:  # ImportError, or RuntimeError from a CUDA-only build
        from torchvision_stub import stub_modules

        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            monkeypatch.delitem(sys.modules, name)
        for name, module in stub_modules().items():
            monkeypatch.setitem(sys.modules, name, module)
    for name in [m for m in sys.modules if m == "timm" or m.startswith("timm.")]:
        monkeypatch.delitem(sys.modules, name)
    yield importlib.import_module("timm")
    for name in set(sys.modules) - before:
        if name.startswith(("timm", "torchvision")):
            sys.modules.pop(name, None)


def test_real_timm_vit(assert_close, tmp_path, timm_module):
    timm = timm_module
    from randattn.activations.torch_vit import capture_timm, load_timm_model

    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
    model.eval()
    out = _check_equality(model, 32, assert_close)
    assert out[0]["q"].shape == (2, 3, 17, 64)
    checkpoint = tmp_path / "tiny.pth"
    torch.save(model.state_dict(), checkpoint)
    loaded = load_timm_model("vit_tiny_patch16_224", checkpoint, img_size=32, patch_size=8, depth=2)
    acts = capture_timm(loaded, "skimage:astronaut", 32, "all", name="vit_tiny_patch16_224")
    assert acts.shape == (1, 3, 17, 64) and acts.scale == 64**-0.5
    assert acts.grid == (4, 4) and acts.prefix_tokens == 1, "32 px / patch 8: CLS then 4 x 4 patches"


@pytest.fixture
def timm_without_torchvision(monkeypatch):
    """timm installed, torchvision not (as after ``pip install --no-deps timm``): ``import torchvision`` raises
    ModuleNotFoundError whether or not a real one is installed; timm is imported afresh and removed again."""
    import importlib.util
    import sys

    if importlib.util.find_spec("timm") is None:
        pytest.skip("timm is not installed (pip install --no-deps timm)")
    before = set(sys.modules)
    for name in [m for m in sys.modules if m.startswith(("timm", "torchvision"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchvision", None)  # None in sys.modules: the import system says it is missing
    yield
    for name in set(sys.modules) - before:
        if name.startswith(("timm", "torchvision")):
            sys.modules.pop(name, None)


def test_missing_torchvision_is_named_not_timm(timm_without_torchvision):
    from randattn.activations.torch_vit import load_timm_model

    with pytest.raises(ModuleNotFoundError) as caught:
        load_timm_model("vit_tiny_patch16_224", None)
    message = str(caught.value)
    assert caught.value.name == "torchvision"
    assert message.startswith("the timm capture needs torchvision, which timm imports: timm is installed but "
                              "torchvision is not")
    assert f"install the torchvision release built for your torch {torch.__version__}" in message


def test_cli_names_missing_torchvision(timm_without_torchvision, tmp_path):
    from click.testing import CliRunner

    from randattn.cli import main

    (tmp_path / "w.pth").write_bytes(b"")
    result = CliRunner().invoke(main, ["capture", "--timm", "vit_tiny_patch16_224", "--checkpoint",
                                       str(tmp_path / "w.pth"), "--out", str(tmp_path / "a.safetensors")],
                                catch_exceptions=False)
    said = " ".join(result.stderr.split())
    assert result.exit_code == 2, result.output
    assert "the timm capture needs torchvision, which timm imports: timm is installed but torchvision is not" in said
    assert "needs timm:" not in said and "randattn[vit]" not in said
    assert not (tmp_path / "a.safetensors").exists()


def test_missing_timm_still_says_timm(monkeypatch):
    import sys

    from randattn.activations import torch_vit

    monkeypatch.setitem(sys.modules, "timm", None)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)  # timm is not installed at all
    with pytest.raises(ModuleNotFoundError, match=r'the timm capture needs timm: pip install "randattn\[timm\]"'):
        torch_vit.load_timm_model("vit_tiny_patch16_224", None)
