"""The canonical target parameter layout, shared by every weight-format loader.

Every loader (:mod:`~dspark_jax.models.llama2c_io`, :mod:`~dspark_jax.models.gguf_io`,
:mod:`~dspark_jax.models.hf_io`; dispatch: :mod:`~dspark_jax.models.model_io`) returns
``(TargetConfig, params)`` with ``params`` a nested dict of float32 numpy arrays in the
canonical layout (kernels ``[in, out]``, so ``y = x @ W``; per-layer tensors stacked on a
leading axis ``L``)::

    {"embed": [V, H],
     "layers": {"attn_norm": [L, H], "wq": [L, H, nH*hd], "wk": [L, H, nKV*hd],
                "wv": [L, H, nKV*hd], "wo": [L, nH*hd, H],
                "q_norm": [L, hd], "k_norm": [L, hd],        # only if cfg.qk_norm
                "post_attn_norm": [L, H], "post_mlp_norm": [L, H],  # only if cfg.sandwich_norms
                "bq": [L, nH*hd], "bk": [L, nKV*hd], "bv": [L, nKV*hd],  # only if cfg.qkv_bias
                "bo": [L, H],                                 # only if cfg.o_bias
                "mlp_norm": [L, H], "w_gate": [L, H, I], "w_up": [L, H, I],
                "w_down": [L, I, H]},
     "final_norm": [H],
     "lm_head": [H, V]}                                       # only if not cfg.tie_embeddings

With sliding and full-attention layers of their own (``cfg.grouped_attention``: Gemma 4), the
attention keys ``wq``/``wk``/``wv``/``wo``/``q_norm``/``k_norm`` stack the sliding layers and
``g_wq``... (:data:`GLOBAL_ATTN_KEYS`; no ``g_wv`` with ``cfg.k_eq_v``) the full-attention layers,
with the full layers' head width and KV heads; ``layer_scalar [L]`` scales each layer's output.

With mixture-of-experts layers (``cfg.num_experts``), ``w_gate``/``w_up``/``w_down`` stack only
the ``Ld`` dense layers (absent when none) and the ``Ls`` sparse layers stack (in layer order)
``moe_router [Ls, H, E]``, ``moe_gate``/``moe_up [Ls, E, H, Im]`` and ``moe_down [Ls, E, Im, H]``
(:func:`layer_members` says which layers each key stacks).

RoPE follows Hugging Face ``rotate_half`` (first/second half of each head).
llama2.c and llama.cpp-converted GGUF files rotate adjacent pairs, so their
q/k output features are permuted per head (:func:`adjacent_to_half`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import numpy as np

from dspark_jax.config import TargetConfig
from dspark_jax.errors import DSparkInputError

Params = dict[str, Any]


def adjacent_to_half(w_out_in: np.ndarray, n_heads: int) -> np.ndarray:
    """Permutes the rows of a ``[n_heads*hd, in]`` q/k matrix from adjacent-pair to half RoPE.

    Within each head the new row order is the even rows then the odd rows (the
    inverse of llama.cpp's converter permutation; the same as Hugging Face's
    ``convert_llama_weights_to_hf.permute``).
    """
    out, d_in = w_out_in.shape
    hd = out // n_heads
    return w_out_in.reshape(n_heads, hd // 2, 2, d_in).transpose(0, 2, 1, 3).reshape(out, d_in)


def owned_f32(a: np.ndarray) -> np.ndarray:
    """A writeable float32 array that owns its memory (never a view into a mapped file)."""
    return np.require(a, np.float32, ["C", "W", "O"])


# A decoder layer's tensors: this project's stacked name -> the Hugging Face (Llama / Qwen3) name
# under ``layers.{i}.`` (also the DSpark checkpoint formats' names, drafters.formats).
HF_LAYER_TENSORS = {
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
# Gemma 2/3 name their norms around the attention and the MLP ("sandwich" norms) differently.
GEMMA_LAYER_TENSORS = {
    **HF_LAYER_TENSORS,
    "post_attn_norm": "post_attention_layernorm",
    "mlp_norm": "pre_feedforward_layernorm",
    "post_mlp_norm": "post_feedforward_layernorm",
}
DENSE_MLP_KEYS = ("w_gate", "w_up", "w_down")
MOE_KEYS = ("moe_router", "moe_gate", "moe_up", "moe_down")
# Grouped attention (Gemma 4): a sliding layer's attention key -> the full-attention layers' key.
GLOBAL_ATTN_KEYS = {k: "g_" + k for k in ("wq", "wk", "wv", "wo", "q_norm", "k_norm")}


def attention_groups(cfg: TargetConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The sliding and the full-attention layers, in order."""
    w = cfg.layer_windows()
    return tuple(i for i in range(cfg.num_layers) if w[i] is not None), tuple(
        i for i in range(cfg.num_layers) if w[i] is None
    )


def layer_members(cfg: TargetConfig) -> dict[str, tuple[int, ...]]:
    """The layers each stacked key of ``params["layers"]`` holds, in order (every layer, except
    the dense MLP keys: the dense layers, and :data:`MOE_KEYS`: the sparse layers)."""
    sparse = cfg.sparse_layers()
    dense_l = tuple(i for i, s in enumerate(sparse) if not s)
    sparse_l = tuple(i for i, s in enumerate(sparse) if s)
    every = tuple(range(cfg.num_layers))
    shapes = target_param_shapes(cfg)["layers"]
    members = {k: dense_l if k in DENSE_MLP_KEYS else sparse_l if k in MOE_KEYS else every for k in shapes}
    if cfg.grouped_attention:
        local, full = attention_groups(cfg)
        members.update({k: local for k in GLOBAL_ATTN_KEYS if k in shapes})
        members.update({k: full for k in GLOBAL_ATTN_KEYS.values() if k in shapes})
    return members


def _grouped_attention_shapes(cfg: TargetConfig) -> dict[str, tuple[int, ...]]:
    """Gemma 4's attention keys (see the module docstring), the layer scalars included."""
    H, nh, (local, full) = cfg.hidden_size, cfg.num_heads, attention_groups(cfg)
    out: dict[str, tuple[int, ...]] = {"layer_scalar": (cfg.num_layers,)}
    for prefix, n, hd, kvh in (
        ("", len(local), cfg.head_dim, cfg.num_kv_heads),
        ("g_", len(full), cfg.global_head_dim or cfg.head_dim, cfg.global_num_kv_heads or cfg.num_kv_heads),
    ):
        if n:
            shapes: dict[str, tuple[int, ...]] = {"wq": (n, H, nh * hd), "wk": (n, H, kvh * hd), "wo": (n, nh * hd, H)}
            shapes["wv"] = (n, H, kvh * hd)
            shapes.update(q_norm=(n, hd), k_norm=(n, hd))
            if prefix and cfg.k_eq_v:
                del shapes["wv"]
            out.update({prefix + k: v for k, v in shapes.items()})
    return out


def _layer_shapes(cfg: TargetConfig, L: int, Ld: int, Ls: int) -> dict[str, tuple[int, ...]]:
    H, I, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    layers = {
        "attn_norm": (L, H),
        "wq": (L, H, q),
        "wk": (L, H, kv),
        "wv": (L, H, kv),
        "wo": (L, q, H),
        "mlp_norm": (L, H),
    }
    if Ld:
        layers.update(w_gate=(Ld, H, I), w_up=(Ld, H, I), w_down=(Ld, I, H))
    if Ls:
        E, Im = cfg.num_experts, cfg.moe_intermediate_size
        layers.update(moe_router=(Ls, H, E), moe_gate=(Ls, E, H, Im), moe_up=(Ls, E, H, Im), moe_down=(Ls, E, Im, H))
    return layers


def target_param_shapes(cfg: TargetConfig) -> dict[str, Any]:
    """Shapes (tuples of ints) of the canonical parameter dict for ``cfg`` (see the module docstring)."""
    L, H, hd = cfg.num_layers, cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    Ls = cfg.num_sparse_layers
    layers = _layer_shapes(cfg, L, L - Ls, Ls)
    if cfg.qk_norm:
        layers.update(q_norm=(L, hd), k_norm=(L, hd))
    if cfg.sandwich_norms:
        layers.update(post_attn_norm=(L, H), post_mlp_norm=(L, H))
    if cfg.qkv_bias:
        layers.update(bq=(L, q), bk=(L, kv), bv=(L, kv))
    if cfg.o_bias:
        layers["bo"] = (L, H)
    if cfg.grouped_attention:
        layers = {k: v for k, v in layers.items() if k not in GLOBAL_ATTN_KEYS} | _grouped_attention_shapes(cfg)
    shapes: dict[str, Any] = {"embed": (cfg.vocab_size, H), "layers": layers, "final_norm": (H,)}
    if not cfg.tie_embeddings:
        shapes["lm_head"] = (H, cfg.vocab_size)
    return shapes


def count_target_params(cfg: TargetConfig, active: bool = False) -> int:
    """Number of target parameters implied by ``cfg`` (no weights needed); ``active``: those one
    token reads (of each sparse layer's experts only ``num_experts_per_tok``)."""
    s = target_param_shapes(cfg)
    leaves = [s["embed"], s["final_norm"], *s["layers"].values()] + ([s["lm_head"]] if "lm_head" in s else [])
    total = int(sum(int(np.prod(x)) for x in leaves))
    if active and cfg.num_sparse_layers:
        idle = cfg.num_experts - cfg.num_experts_per_tok
        total -= sum(int(np.prod(s["layers"][k])) // cfg.num_experts * idle for k in MOE_KEYS[1:])
    return total


def _empty_layers(cfg: TargetConfig) -> dict[str, np.ndarray]:
    return {k: np.empty(s, np.float32) for k, s in target_param_shapes(cfg)["layers"].items()}


def stack_layers(
    cfg: TargetConfig, fetch: Callable[[int, str], np.ndarray], describe: Callable[[int, str], str]
) -> dict[str, np.ndarray]:
    """Stacks per-layer tensors into the canonical ``[L, ...]`` layout.

    ``fetch(i, key)`` returns layer ``i``'s tensor for canonical ``key`` as stored
    (matrices ``[out, in]``, transposed here to ``[in, out]``; expert tensors ``[E, out, in]``,
    each expert's matrix transposed), for the layers :func:`layer_members` gives the key;
    ``describe(i, key)`` names it in the error raised when its shape does not match ``cfg``.
    """
    layers = _empty_layers(cfg)
    members = layer_members(cfg)
    for i in range(cfg.num_layers):
        for key, dst in layers.items():
            if i not in members[key]:
                continue
            m = fetch(i, key)
            m = m.T if m.ndim == 2 else np.swapaxes(m, -1, -2) if m.ndim == 3 else m
            m = m.reshape(()) if key == "layer_scalar" else m
            if m.shape != dst.shape[1:]:
                raise DSparkInputError(f"{describe(i, key)} has shape {m.shape}, expected {dst.shape[1:]}")
            dst[members[key].index(i)] = m
    return layers


def canonical_params(
    cfg: TargetConfig,
    layers: dict[str, np.ndarray],
    embed: np.ndarray,
    final_norm: np.ndarray,
    lm_head: Callable[[], np.ndarray],
) -> Params:
    """Canonical params; ``lm_head()`` (``[V, H]`` as stored) is read only when untied."""
    params = {"embed": embed, "layers": layers, "final_norm": final_norm}
    if not cfg.tie_embeddings:
        params["lm_head"] = np.ascontiguousarray(lm_head().T)
    return params


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
    down = lay["w_down"][-1, 0, :256] if "w_down" in lay else lay["moe_down"][-1, -1, 0, :256]
    wq = lay["wq"] if "wq" in lay else lay["g_wq"]
    pieces += [wq[0, 0, :256], wq[-1, -1, :256], down, params["final_norm"][:256]]
    for a in pieces:
        h.update(np.ascontiguousarray(np.asarray(a, dtype=np.float32)).astype("<f4").tobytes())
    return h.hexdigest()[:16]


def check_target_params(cfg: TargetConfig, params: dict[str, Any]) -> None:
    """Raises ValueError naming every parameter of ``params`` missing or misshapen for ``cfg``."""
    H = cfg.hidden_size
    want = target_param_shapes(cfg)["layers"]
    got = params.get("layers", {})
    problems = []
    for k, shape in want.items():
        if k not in got:
            problems.append(f"layers.{k} missing")
        elif tuple(got[k].shape) != shape:
            problems.append(f"layers.{k} has shape {tuple(got[k].shape)}, expected {shape}")
    embed: Any = params.get("embed")
    lm_head: Any = params.get("lm_head")
    if tuple(np.shape(embed)) != (cfg.vocab_size, H):
        problems.append(f"embed has shape {np.shape(embed)}, expected {(cfg.vocab_size, H)}")
    if not cfg.tie_embeddings and tuple(np.shape(lm_head)) != (H, cfg.vocab_size):
        problems.append("lm_head missing or misshapen")
    if problems:
        raise ValueError("target parameters do not match the config: " + "; ".join(problems))
