"""Wall-clock speedup of speculative decoding at batch 1, with its bound and an outside baseline.

DESIGN.md "Metrics": speedup = tokens per second against plain autoregressive decoding
with the same target, prompts and sampling, measured in one run. For every drafter:

* measured: prompts decoded one at a time (batch 1), plain and speculative interleaved
  prompt by prompt (so load changes on a shared machine hit both alike), compilation
  excluded (:func:`dspark_jax.decoding.speculative.generate_speculative` times execution only) after
  one warm-up call per decoder;
* bound: ``tau * T_target_step / (T_draft + T_verify)`` from jitted micro-benchmarks of
  one plain decode step, one drafting round and one verification pass (target over
  gamma + 1 tokens, rejection sampling, drafter cache update), with the tau measured on
  the same prompts; the gap to the measured figure is the decode loop's overhead;
* outside baseline: ``transformers`` ``generate`` (PyTorch, fp32) on the same weights
  (:func:`hf_llama_from_params` converts the project's canonical parameters, whatever
  file they came from: llama2.c, GGUF or safetensors), same prompts and sampling.

CLI (one exported drafter)::

    python benchmarks/speedup.py --target stories260k --drafter runs/stories260k/export --num-prompts 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.decoding.round import draft_tokens
from dspark_jax.decoding.speculative import generate_autoregressive, generate_speculative
from dspark_jax.decoding.verifier import verify
from dspark_jax.models.sampling import process_logits, sample, sampling_arrays

# ---------------------------------------------------------------------------------- transformers


def hf_llama_from_params(cfg, params):
    """A ``transformers`` ``LlamaForCausalLM`` (fp32, eval mode) holding the same weights.

    Args:
      cfg: :class:`~dspark_jax.config.TargetConfig` (Llama family without q/k-norm).
      params: canonical parameters (kernels ``[in, out]`` stacked per layer, RoPE in the
        Hugging Face ``rotate_half`` layout, as every loader of :mod:`dspark_jax.models.model_io`
        produces).
    Raises:
      ValueError: a Qwen3-style (q/k-norm) target.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if cfg.qk_norm:
        raise ValueError("q/k-norm targets (Qwen3) are not converted here")
    hc = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position,
        rms_norm_eps=cfg.rms_eps,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_embeddings,
        bos_token_id=cfg.bos_id,
        eos_token_id=list(cfg.eos_ids) or None,
        pad_token_id=(list(cfg.eos_ids) or [0])[0],
    )
    model = LlamaForCausalLM(hc).float().eval()
    t = lambda a: torch.from_numpy(np.ascontiguousarray(np.asarray(a, np.float32)))
    lay = params["layers"]
    sd = {"model.embed_tokens.weight": t(params["embed"]), "model.norm.weight": t(params["final_norm"])}
    if not cfg.tie_embeddings:
        sd["lm_head.weight"] = t(np.asarray(params["lm_head"]).T)
    names = {
        "wq": "self_attn.q_proj",
        "wk": "self_attn.k_proj",
        "wv": "self_attn.v_proj",
        "wo": "self_attn.o_proj",
        "w_gate": "mlp.gate_proj",
        "w_up": "mlp.up_proj",
        "w_down": "mlp.down_proj",
    }
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = t(lay["attn_norm"][i])
        sd[p + "post_attention_layernorm.weight"] = t(lay["mlp_norm"][i])
        for k, n in names.items():
            sd[p + n + ".weight"] = t(np.asarray(lay[k][i]).T)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [m for m in missing if not (cfg.tie_embeddings and m == "lm_head.weight") and "rotary_emb" not in m]
    if missing or unexpected:
        raise ValueError(f"weight conversion mismatch: missing {missing}, unexpected {unexpected}")
    if cfg.tie_embeddings:
        model.tie_weights()
    return model


def hf_parity(model, target, ids: Sequence[int]) -> float:
    """Max |logit difference| between transformers and the JAX target on one prompt."""
    import torch

    with torch.no_grad():
        want = model(torch.tensor([list(ids)], dtype=torch.long)).logits[0].float().numpy()
    pos = jnp.arange(len(ids), dtype=jnp.int32)[None]
    got = np.asarray(target(jnp.asarray([list(ids)], jnp.int32), pos).logits[0])
    return float(np.max(np.abs(got - want)))


def hf_generate(
    model, prompt: Sequence[int], max_new_tokens: int, temperature: float, seed: int, eos_ids: Sequence[int]
) -> tuple[list[int], float]:
    """``model.generate`` at batch 1; returns (generated ids, seconds)."""
    import torch

    torch.manual_seed(seed)
    ids = torch.tensor([list(prompt)], dtype=torch.long)
    kw = (
        dict(do_sample=False) if temperature <= 0 else dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    )
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            eos_token_id=list(eos_ids) or None,
            pad_token_id=(list(eos_ids) or [0])[0],
            **kw,
        )
    secs = time.perf_counter() - t0
    return out[0, ids.shape[1] :].tolist(), secs


# ---------------------------------------------------------------------------------- step timings


def _median_time(fn, *args, reps: int = 15) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm-up
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def step_timings(
    target,
    drafter,
    prompt: Sequence[int],
    max_new_tokens: int,
    temperature: float,
    reps: int = 15,
    plain_step: bool = True,
) -> dict[str, float]:
    """Seconds of one plain decode step, one drafting round and one verification pass (batch 1).

    Measured at the middle of a generation (``len(prompt) + max_new_tokens // 2``) with the
    cache length the decode loops use; each piece is a separately jitted function, timed
    by its median over ``reps`` runs after a warm-up. ``drafter=None``: only the plain step;
    ``plain_step=False``: without it.

    Returns:
      ``{"t_target_step", "t_draft", "t_verify"}`` [s] (each only when measured).
    """
    g = drafter.cfg.gamma if drafter is not None else 0
    need = len(prompt) + max_new_tokens + g + 2
    cache_len = min(-(-need // 64) * 64, target.cfg.max_position)
    p = min(len(prompt) + max_new_tokens // 2, cache_len - g - 2)
    taps = drafter.cfg.taps if drafter is not None else ()
    t_graph, t_state = nnx.split(target)
    toks = jnp.asarray(np.resize(np.asarray(prompt, np.int32), p + g + 1)[None])  # a plausible context
    pos = jnp.arange(p, dtype=jnp.int32)[None]
    out = target(toks[:, :p], pos, target.init_cache(1, cache_len), taps=taps)
    tcache = out.cache
    samp = sampling_arrays(1, temperature)
    key = jax.random.PRNGKey(0)[None]
    res: dict[str, float] = {}

    @jax.jit
    def plain(ts, cache, tok, pos1):
        t = nnx.merge(t_graph, ts)
        o = t(tok, pos1, cache)
        return sample(key, process_logits(o.logits[:, 0], samp)), o.cache

    if plain_step or drafter is None:
        res["t_target_step"] = _median_time(
            plain, t_state, tcache, toks[:, p : p + 1], jnp.array([[p]], jnp.int32), reps=reps
        )
    if drafter is None:
        return res
    d_graph, d_state = nnx.split(drafter)
    pos_all = jnp.arange(p, dtype=jnp.int32)[None]
    dcache = drafter.extend_cache(
        drafter.init_cache(1, cache_len), out.features, pos_all, target=target, tokens=toks[:, :p]
    )
    anchor, apos = toks[:, p], jnp.array([p], jnp.int32)

    @jax.jit
    def draft(ts, ds, cache):
        return draft_tokens(nnx.merge(t_graph, ts), nnx.merge(d_graph, ds), anchor, apos, cache, key, samp)

    d_out = draft(t_state, d_state, dcache)
    res["t_draft"] = _median_time(draft, t_state, d_state, dcache, reps=reps)
    vpos = apos[:, None] + jnp.arange(g + 1, dtype=jnp.int32)

    @jax.jit
    def verify_pass(ts, ds, tc, dc, d_tokens, d_probs):
        t, d = nnx.merge(t_graph, ts), nnx.merge(d_graph, ds)
        vtok = jnp.concatenate([anchor[:, None], d_tokens], axis=1)
        o = t(vtok, vpos, tc, taps=taps)
        r = verify(key, d_tokens, d_probs, process_logits(o.logits, samp), jnp.full((1,), g, jnp.int32))
        return r.tokens, o.cache, d.extend_cache(dc, o.features, vpos, target=t, tokens=vtok)

    res["t_verify"] = _median_time(verify_pass, t_state, d_state, tcache, dcache, d_out.tokens, d_out.probs, reps=reps)
    return res


# ---------------------------------------------------------------------------------- measured speedup


def measure_speed(
    target,
    drafters: dict[str, Any],
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float,
    seed: int = 0,
    hf_model=None,
    timing_reps: int = 15,
) -> dict[str, Any]:
    """Batch-1 tokens/s of plain decoding, of each drafter and of transformers, in one process.

    Returns:
      ``{"ar": {...}, "hf_transformers": {...} | None, "drafters": {name: {...}}}`` with
      tokens, seconds, tokens_per_s, and per drafter speedup (vs plain JAX decoding),
      tau, step timings [ms] and the bound ``tau * T_target_step / (T_draft + T_verify)``.
    """
    kw = dict(max_new_tokens=max_new_tokens, temperature=temperature)
    # A value may be (drafter, num_speculative_tokens): the same drafter at several lengths / auto.
    n_spec = {n: (d[1] if isinstance(d, tuple) else None) for n, d in drafters.items()}
    drafters = {n: (d[0] if isinstance(d, tuple) else d) for n, d in drafters.items()}
    # warm-up (compilation of every prompt shape happens outside the timed runs anyway)
    generate_autoregressive(target, [prompts[0]], seed=seed, **kw)
    for n, d in drafters.items():
        generate_speculative(target, d, [prompts[0]], seed=seed, num_speculative_tokens=n_spec[n], **kw)
    ar = {"tokens": 0, "seconds": 0.0}
    sp = {n: {"tokens": 0, "seconds": 0.0, "passes": 0, "emitted": 0, "same_as_ar": 0} for n in drafters}
    hf = {"tokens": 0, "seconds": 0.0, "same_as_ar": 0} if hf_model is not None else None
    eos = list(target.cfg.eos_ids)
    if hf_model is not None:
        hf_generate(hf_model, prompts[0], 4, temperature, seed, eos)
    for i, p in enumerate(prompts):
        a = generate_autoregressive(target, [p], seed=seed + i, **kw)
        ar["tokens"] += a.num_tokens
        ar["seconds"] += a.seconds
        ref = a.generations[0].token_ids
        for n, d in drafters.items():
            s = generate_speculative(target, d, [p], seed=seed + i, num_speculative_tokens=n_spec[n], **kw)
            g = s.generations[0]
            sp[n]["tokens"] += s.num_tokens
            sp[n]["seconds"] += s.seconds
            sp[n]["passes"] += g.num_target_passes
            sp[n]["emitted"] += max(len(g.token_ids) - 1, 0)  # the prefill token is not a verify pass's
            sp[n]["same_as_ar"] += int(g.token_ids == ref)
        if hf is not None:
            ids, secs = hf_generate(hf_model, p, max_new_tokens, temperature, seed + i, eos)
            hf["tokens"] += len(ids)
            hf["seconds"] += secs
            hf["same_as_ar"] += int(ids == ref)
    ar["tokens_per_s"] = ar["tokens"] / max(ar["seconds"], 1e-9)
    base_t = step_timings(target, None, prompts[0], max_new_tokens, temperature, reps=timing_reps)
    ar["ms_per_token"] = 1000 * ar["seconds"] / max(ar["tokens"], 1)
    ar["t_target_step_ms"] = 1000 * base_t["t_target_step"]
    out: dict[str, Any] = {
        "temperature": temperature,
        "num_prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "ar": ar,
        "drafters": {},
    }
    if hf is not None:
        hf["tokens_per_s"] = hf["tokens"] / max(hf["seconds"], 1e-9)
        hf["vs_jax_ar"] = hf["tokens_per_s"] / ar["tokens_per_s"]
    out["hf_transformers"] = hf
    for n, d in drafters.items():
        r = sp[n]
        r["tokens_per_s"] = r["tokens"] / max(r["seconds"], 1e-9)
        r["speedup"] = r["tokens_per_s"] / ar["tokens_per_s"]
        r["tau"] = r["emitted"] / max(r["passes"], 1)
        t = step_timings(target, d, prompts[0], max_new_tokens, temperature, reps=timing_reps, plain_step=False)
        r.update(
            t_target_step_ms=1000 * base_t["t_target_step"],
            t_draft_ms=1000 * t["t_draft"],
            t_verify_ms=1000 * t["t_verify"],
        )
        r["bound"] = r["tau"] * base_t["t_target_step"] / (t["t_draft"] + t["t_verify"])
        out["drafters"][n] = r
    return out


def main(argv: list[str] | None = None) -> int:
    from dspark_jax.api import encode_prompt
    from dspark_jax.drafters.checkpoint import load_drafter
    from dspark_jax.evaluation.cli import load_prompt_texts
    from dspark_jax.models.presets import preset_info, resolve_target
    from dspark_jax.models.target import Target
    from dspark_jax.models.weights import params_fingerprint

    ap = argparse.ArgumentParser(description="Batch-1 speedup of one drafter over plain decoding (+ transformers).")
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", required=True, help="export directory")
    ap.add_argument("--prompts", default="tinystories")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    ap.add_argument(
        "--num-speculative-tokens",
        default="",
        help="comma-separated lengths and/or 'auto' to compare (default: the block size)",
    )
    args = ap.parse_args(argv)
    cfg, params, tok = resolve_target(args.target)
    target = Target(cfg, params, fingerprint=params_fingerprint(params))
    drafter, meta = load_drafter(args.drafter)
    texts, _ = load_prompt_texts(args.prompts, meta)
    chat = bool(preset_info(args.target).get("chat"))
    ids = [encode_prompt(tok, t, chat) for t in texts[: args.num_prompts]]
    hf = None if args.no_hf else hf_llama_from_params(cfg, params)
    lengths = [v.strip() for v in args.num_speculative_tokens.split(",") if v.strip()]
    entries = (
        {f"drafter-{v}": (drafter, v if v == "auto" else int(v)) for v in lengths} if lengths else {"drafter": drafter}
    )
    res = measure_speed(
        target, entries, ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature, hf_model=hf
    )
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
