"""Target-model loaders: llama2.c ``.bin``, GGUF and Hugging Face safetensors directories.

Every loader returns ``(TargetConfig, params)`` with ``params`` a nested dict of
float32 numpy arrays in the canonical layout (kernels ``[in, out]``, so
``y = x @ W``; per-layer tensors stacked on a leading axis ``L``)::

    {"embed": [V, H],
     "layers": {"attn_norm": [L, H], "wq": [L, H, nH*hd], "wk": [L, H, nKV*hd],
                "wv": [L, H, nKV*hd], "wo": [L, nH*hd, H],
                "q_norm": [L, hd], "k_norm": [L, hd],        # only if cfg.qk_norm
                "mlp_norm": [L, H], "w_gate": [L, H, I], "w_up": [L, H, I],
                "w_down": [L, I, H]},
     "final_norm": [H],
     "lm_head": [H, V]}                                       # only if not cfg.tie_embeddings

Each format also has a config-only reader (:func:`llama2c_config`,
:func:`gguf_config`, :func:`hf_config`; dispatch: :func:`read_target_config`)
that reads headers/metadata and never the weights; the loaders call them, so a
config is parsed by exactly one piece of code per format.

RoPE follows Hugging Face ``rotate_half`` (first/second half of each head).
llama2.c and llama.cpp-converted GGUF files rotate adjacent pairs, so their
q/k output features are permuted per head (even indices, then odd indices).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from dspark_jax.config import TargetConfig
from dspark_jax.errors import DSparkInputError

Params = dict[str, Any]

_LAYER_KEYS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")


def adjacent_to_half(w_out_in: np.ndarray, n_heads: int) -> np.ndarray:
    """Permutes the rows of a ``[n_heads*hd, in]`` q/k matrix from adjacent-pair to half RoPE.

    Within each head the new row order is the even rows then the odd rows (the
    inverse of llama.cpp's converter permutation; the same as Hugging Face's
    ``convert_llama_weights_to_hf.permute``).
    """
    out, d_in = w_out_in.shape
    hd = out // n_heads
    return w_out_in.reshape(n_heads, hd // 2, 2, d_in).transpose(0, 2, 1, 3).reshape(out, d_in)


def _owned_f32(a: np.ndarray) -> np.ndarray:
    """A writeable float32 array that owns its memory (never a view into a mapped file)."""
    return np.require(a, np.float32, ["C", "W", "O"])


def target_param_shapes(cfg: TargetConfig) -> dict[str, Any]:
    """Shapes of the canonical parameter dict (see the module docstring) for ``cfg``."""
    L, H, I, hd = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    layers = {
        "attn_norm": (L, H),
        "wq": (L, H, q),
        "wk": (L, H, kv),
        "wv": (L, H, kv),
        "wo": (L, q, H),
        "mlp_norm": (L, H),
        "w_gate": (L, H, I),
        "w_up": (L, H, I),
        "w_down": (L, I, H),
    }
    if cfg.qk_norm:
        layers.update(q_norm=(L, hd), k_norm=(L, hd))
    shapes: dict[str, Any] = {"embed": (cfg.vocab_size, H), "layers": layers, "final_norm": (H,)}
    if not cfg.tie_embeddings:
        shapes["lm_head"] = (H, cfg.vocab_size)
    return shapes


def count_target_params(cfg: TargetConfig) -> int:
    """Number of target parameters implied by ``cfg`` (no weights needed)."""
    s = target_param_shapes(cfg)
    leaves = [s["embed"], s["final_norm"], *s["layers"].values()] + ([s["lm_head"]] if "lm_head" in s else [])
    return int(sum(int(np.prod(x)) for x in leaves))


def _empty_layers(cfg: TargetConfig) -> dict[str, np.ndarray]:
    return {k: np.empty(s, np.float32) for k, s in target_param_shapes(cfg)["layers"].items()}


def _stack_layers(cfg: TargetConfig, fetch, describe) -> dict[str, np.ndarray]:
    """Stacks per-layer tensors into the canonical ``[L, ...]`` layout.

    ``fetch(i, key)`` returns layer ``i``'s tensor for canonical ``key`` as stored
    (matrices ``[out, in]``, transposed here to ``[in, out]``); ``describe(i, key)``
    names it in the error raised when its shape does not match ``cfg``.
    """
    layers = _empty_layers(cfg)
    for i in range(cfg.num_layers):
        for key, dst in layers.items():
            m = fetch(i, key)
            m = m.T if m.ndim == 2 else m
            if m.shape != dst.shape[1:]:
                raise DSparkInputError(f"{describe(i, key)} has shape {m.shape}, expected {dst.shape[1:]}")
            dst[i] = m
    return layers


def _canonical(cfg: TargetConfig, layers, embed: np.ndarray, final_norm: np.ndarray, lm_head) -> Params:
    """Canonical params; ``lm_head()`` (``[V, H]`` as stored) is read only when untied."""
    params = {"embed": embed, "layers": layers, "final_norm": final_norm}
    if not cfg.tie_embeddings:
        params["lm_head"] = np.ascontiguousarray(lm_head().T)
    return params


# --------------------------------------------------------------------------- llama2.c


def _llama2c_layout(path: Path) -> tuple[TargetConfig, list[tuple[str, tuple[int, ...]]]]:
    """Config and tensor layout of a llama2.c checkpoint from its 28-byte header and file size."""
    try:
        with open(path, "rb") as f:
            head = f.read(28)
        size = path.stat().st_size
    except OSError as e:
        raise DSparkInputError(f"cannot read llama2.c checkpoint {path}: {e.strerror}") from None
    if len(head) < 28:
        raise DSparkInputError(f"{path} is too small to be a llama2.c checkpoint ({size // 4 * 4} bytes)")
    hdr = np.frombuffer(head, dtype="<i4").astype(np.int64)
    if int(hdr[0]) == 0x616B3432:
        raise DSparkInputError(
            f"{path} is a versioned llama2.c export (magic 'ak42'); only the legacy version-0 export is supported"
        )
    dim, hidden, L, nh, nkv, vocab, seq = (int(x) for x in hdr)
    shared = vocab > 0
    vocab = abs(vocab)
    if min(dim, hidden, L, nh, nkv, vocab, seq) <= 0 or dim % nh or nh % nkv or (dim // nh) % 2:
        raise DSparkInputError(f"{path}: invalid llama2.c header {hdr.tolist()} (not a llama2.c checkpoint?)")
    hd = dim // nh
    kv = nkv * hd
    sizes = [
        ("embed", (vocab, dim)),
        ("attn_norm", (L, dim)),
        ("wq", (L, dim, dim)),
        ("wk", (L, kv, dim)),
        ("wv", (L, kv, dim)),
        ("wo", (L, dim, dim)),
        ("mlp_norm", (L, dim)),
        ("w1", (L, hidden, dim)),
        ("w2", (L, dim, hidden)),
        ("w3", (L, hidden, dim)),
        ("final_norm", (dim,)),
        ("freq_cis", (2, seq, hd // 2)),
    ] + ([] if shared else [("wcls", (vocab, dim))])
    expected = 7 + sum(int(np.prod(s)) for _, s in sizes)
    if size != expected * 4:
        raise DSparkInputError(
            f"{path}: llama2.c checkpoint is {size} bytes but its header "
            f"(dim={dim} hidden={hidden} layers={L} heads={nh}/{nkv} vocab={vocab} seq={seq}) "
            f"implies {expected * 4} bytes (truncated or corrupt file)"
        )
    cfg = TargetConfig(
        vocab_size=vocab,
        hidden_size=dim,
        intermediate_size=hidden,
        num_layers=L,
        num_heads=nh,
        num_kv_heads=nkv,
        head_dim=hd,
        max_position=seq,
        rope_theta=10000.0,
        rms_eps=1e-5,
        tie_embeddings=shared,
        qk_norm=False,
        bos_id=1,
        eos_ids=(1, 2),
        name=path.stem,
    )
    return cfg, sizes


def llama2c_config(bin_path: str | Path) -> TargetConfig:
    """The :class:`TargetConfig` of a llama2.c checkpoint (header and file size only).

    Raises:
      DSparkInputError: as :func:`load_llama2c`.
    """
    return _llama2c_layout(Path(bin_path))[0]


def load_llama2c(bin_path: str | Path) -> tuple[TargetConfig, Params]:
    """Loads a llama2.c legacy (version-0) float32 checkpoint (``run.c`` layout).

    Header: 7 little-endian int32 ``dim, hidden_dim, n_layers, n_heads,
    n_kv_heads, vocab_size, seq_len`` (negative vocab = separate classifier at
    the end); then float32 ``[out, in]`` weights in run.c order; the legacy
    ``freq_cis`` tables are skipped. ``eos_ids = (1, 2)``: run.c stops when BOS
    is generated. RMSNorm eps 1e-5, RoPE theta 10000.

    Raises:
      DSparkInputError: unreadable file, a versioned (``ak42``) export, or a
        size that does not match the header (truncated/corrupt).
    """
    path = Path(bin_path)
    cfg, sizes = _llama2c_layout(path)
    nh, nkv, shared = cfg.num_heads, cfg.num_kv_heads, cfg.tie_embeddings
    try:
        raw = np.fromfile(path, dtype="<f4")
    except OSError as e:
        raise DSparkInputError(f"cannot read llama2.c checkpoint {path}: {e.strerror}") from None
    w, off = {}, 7
    for name, shape in sizes:
        n = int(np.prod(shape))
        w[name] = raw[off : off + n].reshape(shape)
        off += n
    T = lambda a: np.ascontiguousarray(np.swapaxes(a, -1, -2))
    layers = {
        "attn_norm": w["attn_norm"].copy(),
        "wq": T(np.stack([adjacent_to_half(m, nh) for m in w["wq"]])),
        "wk": T(np.stack([adjacent_to_half(m, nkv) for m in w["wk"]])),
        "wv": T(w["wv"]),
        "wo": T(w["wo"]),
        "mlp_norm": w["mlp_norm"].copy(),
        "w_gate": T(w["w1"]),
        "w_up": T(w["w3"]),
        "w_down": T(w["w2"]),
    }
    params = {"embed": w["embed"].copy(), "layers": layers, "final_norm": w["final_norm"].copy()}
    if not shared:
        params["lm_head"] = T(w["wcls"])
    return cfg, params


# --------------------------------------------------------------------------- GGUF

_GGUF_ARCHS = ("llama", "qwen3")  # qwen3: HF-style half RoPE (no permutation) + q/k norms
_GGUF_NAMES = {
    "attn_norm": "attn_norm",
    "wq": "attn_q",
    "wk": "attn_k",
    "wv": "attn_v",
    "wo": "attn_output",
    "mlp_norm": "ffn_norm",
    "w_gate": "ffn_gate",
    "w_up": "ffn_up",
    "w_down": "ffn_down",
    "q_norm": "attn_q_norm",
    "k_norm": "attn_k_norm",
}


def _f32(x: float) -> float:
    """The shortest decimal of a float32 metadata value (1e-5, not 9.99999974e-06)."""
    return float(str(np.float32(x)))


def open_gguf(path: str | Path) -> Any:
    """Opens a GGUF file with ``gguf.GGUFReader`` (memory-mapped, ~3 s for 49k-token vocabularies).

    Raises:
      DSparkInputError: unreadable or not a GGUF file.
    """
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except (OSError, ValueError, IndexError) as e:
        raise DSparkInputError(
            f"cannot read GGUF file {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from None


def _as_reader(path: Any) -> Any:
    import gguf

    return path if isinstance(path, gguf.GGUFReader) else open_gguf(path)


def _gguf_name(reader: Any) -> Path:
    return Path(reader.data.filename if hasattr(reader.data, "filename") else "model.gguf")


def gguf_config(path: Any) -> TargetConfig:
    """The :class:`TargetConfig` of a GGUF file from its metadata (no tensor data is read).

    Hyperparameters come from ``{arch}.*`` metadata (see :func:`load_gguf`); tied
    embeddings when there is no ``output.weight`` tensor.

    Args:
      path: a ``.gguf`` path or an open ``gguf.GGUFReader``.
    Raises:
      DSparkInputError: unreadable file, unsupported architecture, missing metadata.
    """
    reader = _as_reader(path)
    fname = _gguf_name(reader)

    def meta(key, default=None, required=False):
        f = reader.fields.get(key)
        if f is None:
            if required:
                raise DSparkInputError(f"GGUF file {fname.name} lacks metadata key {key!r}")
            return default
        return f.contents()

    arch = meta("general.architecture", required=True)
    if arch not in _GGUF_ARCHS:
        raise DSparkInputError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(_GGUF_ARCHS)})")
    tensors = {t.name: t for t in reader.tensors}
    H = int(meta(f"{arch}.embedding_length", required=True))
    nh = int(meta(f"{arch}.attention.head_count", required=True))
    nkv = int(meta(f"{arch}.attention.head_count_kv", nh))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = len(tokens.data) if tokens is not None else int(tensors["token_embd.weight"].shape[-1])
    bos = meta("tokenizer.ggml.bos_token_id")
    eos = [meta("tokenizer.ggml.eos_token_id"), meta("tokenizer.ggml.eot_token_id")]
    return TargetConfig(
        vocab_size=vocab,
        hidden_size=H,
        intermediate_size=int(meta(f"{arch}.feed_forward_length", required=True)),
        num_layers=int(meta(f"{arch}.block_count", required=True)),
        num_heads=nh,
        num_kv_heads=nkv,
        head_dim=int(meta(f"{arch}.attention.key_length", H // nh)),
        max_position=int(meta(f"{arch}.context_length", 2048)),
        rope_theta=_f32(meta(f"{arch}.rope.freq_base", 10000.0)),
        rms_eps=_f32(meta(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in tensors,
        qk_norm=arch == "qwen3",
        bos_id=None if bos is None else int(bos),
        eos_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
        name=fname.stem,
    )


def load_gguf(path: Any) -> tuple[TargetConfig, Params]:
    """Loads a llama.cpp GGUF checkpoint (architectures ``llama`` and ``qwen3``).

    Hyperparameters come from ``{arch}.*`` metadata (``block_count``,
    ``embedding_length``, ``feed_forward_length``, ``attention.head_count[_kv]``,
    ``attention.key_length``, ``rope.freq_base``,
    ``attention.layer_norm_rms_epsilon``, ``context_length``), the vocabulary
    size from ``tokenizer.ggml.tokens`` (else ``token_embd``). Tensors of any
    type supported by ``gguf.quants.dequantize`` (F32/F16/Q8_0/Q4_1/...) become
    float32; a GGUF shape ``[in, out]`` is a numpy ``[out, in]`` matrix,
    transposed here to ``[in, out]``. ``llama`` q/k rows are permuted from
    adjacent-pair to half RoPE. No ``output.weight`` means tied embeddings.

    Args:
      path: a ``.gguf`` path or an open ``gguf.GGUFReader`` (reading the header
        of a large-vocabulary file takes seconds, so callers may share it).

    Raises:
      DSparkInputError: unreadable file, unsupported architecture, missing tensors.
    """
    import gguf

    reader = _as_reader(path)
    fname = _gguf_name(reader)
    cfg = gguf_config(reader)
    arch = reader.fields["general.architecture"].contents()
    nh, nkv = cfg.num_heads, cfg.num_kv_heads
    tensors = {t.name: t for t in reader.tensors}

    def get(name: str) -> np.ndarray:
        t = tensors.get(name)
        if t is None:
            raise DSparkInputError(f"GGUF file {fname.name} lacks tensor {name!r}")
        # A plain-ndarray view avoids numpy.memmap's per-slice overhead (3x faster).
        return _owned_f32(gguf.quants.dequantize(t.data.view(np.ndarray), t.tensor_type))

    permute = {"wq": nh, "wk": nkv} if arch == "llama" else {}

    def fetch(i: int, key: str) -> np.ndarray:
        m = get(f"blk.{i}.{_GGUF_NAMES[key]}.weight")
        return adjacent_to_half(m, permute[key]) if key in permute and m.ndim == 2 else m

    layers = _stack_layers(cfg, fetch, lambda i, key: f"GGUF tensor blk.{i}.{_GGUF_NAMES[key]}")
    return cfg, _canonical(
        cfg, layers, get("token_embd.weight"), get("output_norm.weight"), lambda: get("output.weight")
    )


# --------------------------------------------------------------------------- Hugging Face

_ST_DTYPES = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "F64": "<f8"}


def _safetensors_index(files: list[Path]) -> dict[str, tuple[Path, str, tuple[int, ...], int, int]]:
    """Maps tensor name -> (file, dtype, shape, begin, end) from safetensors headers."""
    index = {}
    for f in files:
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name != "__metadata__":
                b, e = info["data_offsets"]
                index[name] = (f, info["dtype"], tuple(info["shape"]), 8 + n + b, 8 + n + e)
    return index


def _read_st(entry: tuple[Path, str, tuple[int, ...], int, int]) -> np.ndarray:
    """Reads one safetensors tensor as float32 (F32/F16/BF16/F64), memory-mapped."""
    f, dtype, shape, b, e = entry
    if dtype not in _ST_DTYPES:
        raise DSparkInputError(f"{f.name}: unsupported safetensors dtype {dtype}")
    a = np.memmap(
        f, dtype=_ST_DTYPES[dtype], mode="r", offset=b, shape=((e - b) // np.dtype(_ST_DTYPES[dtype]).itemsize,)
    )
    if dtype == "BF16":
        a = (a.astype(np.uint32) << 16).view(np.float32)
    return _owned_f32(a).reshape(shape)


def hf_target_config(
    c: Any, *, where: str, name: str, lm_head_in_weights: bool | None = None, generation_eos: Any = ()
) -> TargetConfig:
    """:class:`TargetConfig` from a ``transformers`` config object (``LlamaConfig``/``Qwen3Config``).

    ``rope_theta`` comes from ``rope_parameters``/``rope_scaling`` or the attribute,
    ``head_dim`` when present, tied embeddings from ``tie_word_embeddings`` (or from
    the weights lacking ``lm_head.weight`` when ``lm_head_in_weights`` is known); EOS
    ids are the config's joined with ``generation_eos`` (``generation_config.json``).

    Args:
      c: the config (``AutoConfig.from_pretrained`` or ``AutoConfig.for_model``).
      where: what to name in error messages (a path or a preset).
      name: :attr:`TargetConfig.name`.
    Raises:
      DSparkInputError: an unsupported architecture, RoPE scaling, biases or activation.
    """
    if c.model_type not in ("llama", "qwen3"):
        raise DSparkInputError(f"{where}: model_type {c.model_type!r} is not supported (supported: llama, qwen3)")
    rp = dict(getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {})
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type not in ("default", None):
        raise DSparkInputError(f"{where}: RoPE scaling {rope_type!r} is not supported (only plain RoPE)")
    theta = rp.get("rope_theta", getattr(c, "rope_theta", None)) or 10000.0
    if getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False):
        raise DSparkInputError(f"{where}: attention/MLP biases are not supported")
    if getattr(c, "hidden_act", "silu") != "silu":
        raise DSparkInputError(f"{where}: activation {c.hidden_act!r} is not supported (only silu)")
    eos = list(c.eos_token_id) if isinstance(c.eos_token_id, (list, tuple)) else [c.eos_token_id]
    eos += list(generation_eos) if isinstance(generation_eos, (list, tuple)) else [generation_eos]
    nh = c.num_attention_heads
    tie = bool(getattr(c, "tie_word_embeddings", False)) or lm_head_in_weights is False
    return TargetConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_layers=c.num_hidden_layers,
        num_heads=nh,
        num_kv_heads=getattr(c, "num_key_value_heads", None) or nh,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // nh,
        max_position=c.max_position_embeddings,
        rope_theta=float(theta),
        rms_eps=float(c.rms_norm_eps),
        tie_embeddings=tie,
        qk_norm=c.model_type == "qwen3",
        bos_id=c.bos_token_id,
        eos_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
        name=name,
    )


def _hf_dir_config(path: Path, index: dict | None) -> TargetConfig:
    """Config of a Hugging Face directory: ``AutoConfig`` + ``generation_config.json`` EOS ids;
    ``index`` (safetensors headers, if any) tells whether ``lm_head.weight`` exists."""
    from transformers import AutoConfig

    try:
        c = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise DSparkInputError(f"cannot read Hugging Face config in {path}: {str(e).splitlines()[0]}") from None
    gen = path / "generation_config.json"
    gen_eos = json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None
    return hf_target_config(
        c,
        where=str(path),
        name=path.resolve().name,
        generation_eos=gen_eos,
        lm_head_in_weights=None if index is None else "lm_head.weight" in index,
    )


def hf_config(path: str | Path) -> TargetConfig:
    """The :class:`TargetConfig` of a Hugging Face model directory without reading weights
    (``config.json``, ``generation_config.json`` and the safetensors *headers*, if present).

    Raises:
      DSparkInputError: as :func:`load_hf_dir` for the config.
    """
    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    return _hf_dir_config(path, _safetensors_index(files) if files else None)


def load_hf_dir(path: str | Path) -> tuple[TargetConfig, Params]:
    """Loads a Hugging Face ``LlamaForCausalLM``/``Qwen3ForCausalLM`` safetensors directory.

    Config via ``transformers.AutoConfig`` (:func:`hf_target_config`; EOS ids joined
    with ``generation_config.json``). Weights from every ``*.safetensors`` file (F32,
    F16 and BF16 are converted to float32); ``[out, in]`` matrices are
    transposed to ``[in, out]``. HF already uses half RoPE: no permutation.

    Raises:
      DSparkInputError: no config/weights, an unsupported architecture or RoPE
        scaling, biases, or missing tensors.
    """
    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    index = _safetensors_index(files) if files else None
    cfg = _hf_dir_config(path, index)  # config errors first, then missing weights
    if index is None:
        raise DSparkInputError(f"{path}: no *.safetensors weight files (PyTorch .bin checkpoints are not supported)")

    def get(name: str) -> np.ndarray:
        if name not in index:
            raise DSparkInputError(f"{path}: weight {name!r} not found in the safetensors files")
        return _read_st(index[name])

    hf = {
        "attn_norm": "input_layernorm",
        "wq": "self_attn.q_proj",
        "wk": "self_attn.k_proj",
        "wv": "self_attn.v_proj",
        "wo": "self_attn.o_proj",
        "q_norm": "self_attn.q_norm",
        "k_norm": "self_attn.k_norm",
        "mlp_norm": "post_attention_layernorm",
        "w_gate": "mlp.gate_proj",
        "w_up": "mlp.up_proj",
        "w_down": "mlp.down_proj",
    }
    layers = _stack_layers(
        cfg, lambda i, key: get(f"model.layers.{i}.{hf[key]}.weight"), lambda i, key: f"{path}: layer {i} {hf[key]}"
    )
    return cfg, _canonical(
        cfg, layers, get("model.embed_tokens.weight"), get("model.norm.weight"), lambda: get("lm_head.weight")
    )


# --------------------------------------------------------------------------- dispatch


def _is_tokenizer_bin(p: Path) -> bool:
    return p.suffix == ".bin" and (p.name.startswith("tok") or p.name == "tokenizer.bin")


def _llama2c_with_tokenizer(bin_path: Path):
    from dspark_jax.models.tokenizer import Llama2cTokenizer

    cfg, params = load_llama2c(bin_path)
    cands = sorted(p for p in bin_path.parent.glob("*.bin") if _is_tokenizer_bin(p))
    for p in cands:
        try:
            tok = Llama2cTokenizer.from_file(p)
        except DSparkInputError:
            continue
        if tok.vocab_size == cfg.vocab_size:
            return cfg, params, tok
    raise DSparkInputError(
        f"no llama2.c tokenizer with vocab {cfg.vocab_size} next to {bin_path.name}: expected a tok*.bin "
        f"or tokenizer.bin in {bin_path.parent} (found: {', '.join(p.name for p in cands) or 'none'})"
    )


_EXPECTED = (
    "expected a .gguf file, a llama2.c .bin checkpoint (with tok*.bin beside it), or a directory "
    "holding a Hugging Face config.json + *.safetensors, one .gguf, or a llama2.c .bin + tok*.bin"
)


def _model_kind(path: str | Path) -> tuple[str, Path]:
    """``("hf" | "gguf" | "llama2c", path)`` of a model path (format detection shared by the
    loader and the config reader).

    Raises:
      DSparkInputError: missing path or unrecognised contents.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise DSparkInputError(f"model path {p} does not exist; {_EXPECTED}")
    if p.is_dir():
        if (p / "config.json").is_file():
            return "hf", p
        ggufs = sorted(p.glob("*.gguf"))
        bins = sorted(b for b in p.glob("*.bin") if not _is_tokenizer_bin(b))
        if len(ggufs) == 1:
            p = ggufs[0]
        elif len(ggufs) == 0 and len(bins) == 1:
            p = bins[0]
        else:
            found = ", ".join(x.name for x in ggufs + bins) or "nothing usable"
            raise DSparkInputError(f"cannot pick a model in directory {p} (found: {found}); {_EXPECTED}")
    if p.suffix == ".gguf":
        return "gguf", p
    if p.suffix == ".bin" and not _is_tokenizer_bin(p):
        return "llama2c", p
    raise DSparkInputError(f"unrecognised model file {p}; {_EXPECTED}")


def read_target_config(path: str | Path) -> TargetConfig:
    """The :class:`TargetConfig` of a model path without loading its weights.

    Same formats and detection as :func:`load_target_files`; reads only the
    llama2.c header, the GGUF metadata, or the Hugging Face ``config.json`` (plus
    safetensors headers).

    Raises:
      DSparkInputError: missing path, unrecognised contents or an unreadable config.
    """
    kind, p = _model_kind(path)
    return {"hf": hf_config, "gguf": gguf_config, "llama2c": llama2c_config}[kind](p)


def load_target_files(path: str | Path):
    """Loads ``(cfg, params, tokenizer)`` from a path, detecting the format.

    Accepted: a ``.gguf`` file; a llama2.c ``.bin`` (its tokenizer is the
    ``tok*.bin``/``tokenizer.bin`` beside it whose vocabulary size matches); a
    directory with ``config.json`` (Hugging Face), exactly one ``.gguf``, or one
    llama2.c model ``.bin`` plus its tokenizer.

    Raises:
      DSparkInputError: missing path or unrecognised contents (the message says
        what was expected), plus any loader error.
    """
    from dspark_jax.models.tokenizer import HFTokenizer, gguf_tokenizer

    kind, p = _model_kind(path)
    if kind == "hf":
        cfg, params = load_hf_dir(p)
        return cfg, params, HFTokenizer(p)
    if kind == "gguf":
        reader = open_gguf(p)
        cfg, params = load_gguf(reader)
        return cfg, params, gguf_tokenizer(reader)
    return _llama2c_with_tokenizer(p)


def params_fingerprint(params: Params) -> str:
    """A short stable hash (16 hex chars) identifying exact target weights.

    sha256 over every leaf's path and shape plus a few deterministic float32
    slices (rows of ``embed``, the first and last layer's q and down
    projections, ``final_norm``). Accepts numpy or JAX arrays.
    """
    h = hashlib.sha256()

    def leaves(d, prefix=""):
        for k in sorted(d):
            v = d[k]
            if isinstance(v, dict):
                yield from leaves(v, f"{prefix}{k}/")
            else:
                yield f"{prefix}{k}", v

    for name, v in leaves(params):
        h.update(f"{name}:{tuple(np.shape(v))};".encode())
    emb = params["embed"]
    V = np.shape(emb)[0]
    pieces = [emb[r, :256] for r in sorted({0, 1, V // 2, V - 1})]
    lay = params["layers"]
    pieces += [lay["wq"][0, 0, :256], lay["wq"][-1, -1, :256], lay["w_down"][-1, 0, :256], params["final_norm"][:256]]
    for a in pieces:
        h.update(np.ascontiguousarray(np.asarray(a, dtype=np.float32)).astype("<f4").tobytes())
    return h.hexdigest()[:16]
