"""Prints the parity table of docs/results.md: max |logit diff| against transformers (fp32) of each
target family's tiny random model, through the same writers and loaders as the exactness tests
(tests/unit/models/: test_target_families.py, test_sliding_window.py, test_gemma.py, test_gemma4.py),
cache-less and cached.

    python -m tests.helpers.parity_report   # from the repository root, about a minute on 2 CPU cores
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from dspark_jax.models.gguf_io import load_gguf
from dspark_jax.models.hf_io import load_hf_dir
from dspark_jax.models.target import Target
from tests.helpers.gguf_files import write_gguf
from tests.unit.models import test_gemma as tg
from tests.unit.models import test_gemma4 as tg4
from tests.unit.models import test_sliding_window as tsw
from tests.unit.models import test_target_families as ttf

GEMMA3_LLAMACPP_ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 50000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
}


def cached_logits(cfg, params, ids, chunks):
    """Logits ``[T, V]`` through the KV cache: prefill ``chunks[0]`` tokens, then the other chunks."""
    target = Target(cfg, params)
    pos = np.arange(len(ids), dtype=np.int32)[None]
    cache, parts, start = target.init_cache(1, len(ids)), [], 0
    for n in (*chunks, len(ids) - sum(chunks)):
        out = target(ids[None, start : start + n], pos[:, start : start + n], cache)
        cache, start = out.cache, start + n
        parts.append(np.asarray(out.logits[0]))
    return np.concatenate(parts)


def full_logits(cfg, params, ids):
    return np.asarray(Target(cfg, params)(ids[None], np.arange(len(ids), dtype=np.int32)[None]).logits[0])


def diffs(cfg, params, ids, want, chunks):
    a = np.abs(full_logits(cfg, params, ids) - want).max()
    b = np.abs(cached_logits(cfg, params, ids, chunks) - want).max()
    return float(np.abs(want).max()), float(a), float(b)


GEMMA4_LABELS = {
    "k_eq_v": "gemma4_text: full layers 32-wide x 1 KV head, k = v, proportional RoPE 0.5",
    "v_proj": "gemma4_text: 3 sliding + 1 full (v_proj), default RoPE",
    "unified": "gemma4_unified_text (as `k_eq_v`)",
}


def gemma4_rows(tmp: Path) -> list[tuple]:
    """The Gemma 4 text rows: test_gemma4's tiny models (40 positions, window 8)."""
    rows = []
    for name, label in GEMMA4_LABELS.items():
        model = tg4._write(tmp / f"g4-{name}", name == "unified", **tg4.VARIANTS[name])
        cfg, params = load_hf_dir(tmp / f"g4-{name}")
        ids = tg4._ids()
        test = "test_gemma4.py::test_logits_match_transformers_past_the_window"
        rows.append((label, "HF", *diffs(cfg, params, ids, tg._hf_logits(model, ids), (17, 1)), test))
    return rows


def attention_bias_rows(tmp: Path) -> list[tuple]:
    """``attention_bias: true`` (q/k/v and o_proj biases): Llama and Qwen3 from HF, Llama from GGUF."""
    rows, test = [], "test_target_families.py::test_attention_bias_matches_transformers"
    for kind in ("llama", "qwen3"):
        model = ttf.make_hf(kind, None, tmp / f"ab-{kind}", seed=5, attention_bias=True)
        ids = ttf.tokens(2)
        want = ttf.hf_logits(model, ids)
        cfg, params = load_hf_dir(tmp / f"ab-{kind}")
        rows.append((f"{kind} attention_bias", "HF", *diffs(cfg, params, ids, want, (40, 3, 1)), test))
        if kind == "llama":
            rope = {"rope_type": "default", "rope_theta": 10000.0}
            cfg, params = load_gguf(ttf.write_gguf(model, rope, "llama", tmp / "ab.gguf"))
            rows.append(("llama attention_bias, as `llama`", "GGUF", *diffs(cfg, params, ids, want, (40, 3, 1)), test))
    return rows


def main():
    rows = []
    tmp = Path(tempfile.mkdtemp())
    for name in sorted(ttf.CASES):
        kind, rope = ttf.CASES[name]
        model = ttf.make_hf(kind, rope, tmp / name)
        ids = ttf.tokens()
        cfg, params = load_hf_dir(tmp / name)
        test = "test_target_families.py::test_hf_matches_transformers_past_original_context"
        rows.append((name, "HF", *diffs(cfg, params, ids, ttf.hf_logits(model, ids), (40, 3, 1)), test))
    for name in ("llama-llama3", "llama-linear", "qwen2-yarn"):
        kind, rope = ttf.CASES[name]
        model = ttf.make_hf(kind, rope, tmp / f"g-{name}", seed=3)
        cfg, params = load_gguf(ttf.write_gguf(model, rope, kind, tmp / f"{name}.gguf"))
        ids = ttf.tokens(1)
        test = "test_target_families.py::test_gguf_matches_transformers_past_original_context"
        rows.append((name, "GGUF", *diffs(cfg, params, ids, ttf.hf_logits(model, ids), (40, 3, 1)), test))
    rows += attention_bias_rows(tmp)
    for kind in ("mistral", "ministral", "qwen3"):
        model = tsw._write(kind, tmp / f"sw-{kind}")
        cfg, params = load_hf_dir(tmp / f"sw-{kind}")
        ids = np.asarray([1] + np.random.default_rng(0).integers(3, cfg.vocab_size, 45).tolist(), np.int32)
        want = tsw._hf_logits(model, ids.tolist())
        label = {"mistral": "mistral (window 8)", "ministral": "ministral (layer 1 full, window 8)"}.get(
            kind, "qwen3 sliding (layers 1-2, window 8)"
        )
        test = "test_sliding_window.py::test_logits_match_transformers_past_the_window"
        if kind == "ministral":
            test = "test_sliding_window.py::test_ministral_layer_types_match_transformers"
        rows.append((label, "HF", *diffs(cfg, params, ids, want, (40, 1, 1, 1)), test))
        if kind == "ministral":  # no GGUF row
            continue
        arch, pattern = ("llama", None) if kind == "mistral" else ("qwen3", [False, True, True])

        def window_kv(w, pattern=pattern):
            w.add_sliding_window(tsw.WINDOW)
            if pattern is not None:
                w.add_sliding_window_pattern(pattern)

        write_gguf(tmp / f"sw-{kind}.gguf", arch, cfg, params, arch == "llama", window_kv)
        gcfg, gparams = load_gguf(tmp / f"sw-{kind}.gguf")
        test = "test_sliding_window.py::test_gguf_window"
        rows.append(
            (f"{label}, as `{arch}` + window keys", "GGUF", *diffs(gcfg, gparams, ids, want, (40, 1, 1, 1)), test)
        )
    for kind in ("gemma2", "gemma3"):
        model = tg._write(kind, tmp / kind)
        cfg, params = load_hf_dir(tmp / kind)
        ids = tg._ids()
        test = "test_gemma.py::test_logits_match_transformers_past_the_window"
        rows.append((kind, "HF", *diffs(cfg, params, ids, tg._hf_logits(model, ids), (20, 3, 1, 1)), test))
    model = tg._write("gemma3", tmp / "g3-6", num_hidden_layers=7, final_logit_softcapping=None,
                      sliding_window_pattern=6, rope_parameters=GEMMA3_LLAMACPP_ROPE, layer_types=None)  # fmt: skip
    cfg, params = load_gguf(tg._write_gemma3_gguf(model, tmp / "g3.gguf"))
    ids = tg._ids()
    test = "test_gemma.py::test_gemma3_gguf_matches_transformers"
    label = "gemma3, 7 layers (every 6th full, local RoPE base 1e4), as `gemma3`"
    rows.append((label, "GGUF", *diffs(cfg, params, ids, tg._hf_logits(model, ids), (20, 3, 1, 1)), test))
    model = tg._write("gemma2", tmp / "g2-gguf", query_pre_attn_scalar=16)
    cfg, params = load_gguf(tg._write_gemma2_gguf(model, tmp / "g2.gguf"))
    test = "test_gemma.py::test_gemma2_gguf_matches_transformers"
    label = "gemma2 (even layers slide, query scale head_dim ** -0.5), as `gemma2`"
    rows.append((label, "GGUF", *diffs(cfg, params, ids, tg._hf_logits(model, ids), (20, 3, 1, 1)), test))
    rows += gemma4_rows(tmp)
    print("| family | source | max abs logit | max abs logit diff, cache-less | through the KV cache | test |")
    print("|---|---|---|---|---|---|")
    for name, src, m, a, b, test in rows:
        print(f"| {name} | {src} | {m:.2f} | {a:.2e} | {b:.2e} | `{test}` |")


if __name__ == "__main__":
    main()
