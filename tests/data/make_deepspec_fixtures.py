"""Writes ``tests/data/deepspec``: tiny DSpark drafters written by DeepSpec's own code, with its logits.

DeepSpec (github.com/deepseek-ai/DeepSpec) is not on PyPI and this repository copies none of its
code: the script imports it from a checkout given on the command line and runs, on the CPU in
float32,

* transformers' ``Qwen3ForCausalLM`` for a tiny random target (``target/``, ``save_pretrained``);
* DeepSpec's ``build_draft_config`` (from the target's config and the drafter arguments below) and
  ``Qwen3DSparkModel`` for each drafter: random weights, the target's embedding and LM head copied
  in with its ``initialize_embeddings_and_head``, ``save_pretrained`` into ``<name>/``;
* DeepSpec's training forward (``Qwen3DSparkModel.forward``: anchors sampled by its own
  ``sample_anchor_positions`` under a fixed torch seed, its flex-attention block mask) on the
  target's tapped features as DeepSpec trains on them: its ``run_target_forward_with_hooks``
  (``scripts/data/prepare_target_cache.py``, forward hooks on the decoder layers: every tap, the
  last layer's too, is a decoder layer's raw output, before the final norm). Saved in
  ``<name>/reference.npz``: the tokens, the sampled anchors, the draft logits (Markov bias
  included) and the confidence logits; and, as ``eval_draft_logits``, the draft logits on the
  features DeepSpec's evaluator builds (``extract_context_feature`` over transformers'
  ``hidden_states``, whose entry L is after the final norm: the evaluator refuses a tap of the last
  layer for that reason, ``assert_no_final_target_layer``).

``--only gemma4`` writes the Gemma 4 drafters alone (``gemma4_*/``, the other fixtures left as they
are): DeepSpec's ``gemma4.build_draft_config`` from a tiny ``Gemma4Config`` (its config only; no
Gemma 4 target model is built) and ``Gemma4DSparkModel`` with random weights (its own embedding and
LM head included) and layer scalars other than 1, saved with ``save_pretrained``; its training
forward on fixed random target features ``[1, 20, n_taps * H]`` gives the reference logits. Run it
under DeepSpec's pinned transformers 5.10.2 (README): transformers 5.25's ``Gemma4TextConfig`` no
longer keeps ``global_head_dim`` / ``num_global_key_value_heads`` as attributes (DeepSpec asserts
them) and its rotary embedding no longer takes DeepSpec's ``layer_type`` argument.

Run (from the repository root; transformers, torch and safetensors installed):
``python tests/data/make_deepspec_fixtures.py --deepspec /path/to/DeepSpec [--only gemma4]``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "deepspec"
SEED = 20261205
SEQ_LEN = 20
NUM_ANCHORS = 4
# The tiny target: 3 layers, so tap 2 is its last layer (L - 1).
TARGET = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
MASK_TOKEN_ID = 95
# name -> DeepSpec model arguments (config/dspark/*.py's keys) beyond the shared ones.
DRAFTERS = {
    "vanilla": dict(target_layer_ids=[0, 2], markov_rank=8, markov_head_type="vanilla",
                    confidence_head_alpha=1.0, confidence_head_with_markov=True, num_draft_layers=1),
    "gated": dict(target_layer_ids=[1, 2], markov_rank=8, markov_head_type="gated",
                  confidence_head_alpha=1.0, confidence_head_with_markov=False, num_draft_layers=1),
    "rnn": dict(target_layer_ids=[0, 1, 2], markov_rank=8, markov_head_type="rnn",
                confidence_head_alpha=1.0, confidence_head_with_markov=True, num_draft_layers=2),
    "dflash": dict(target_layer_ids=[0, 2], markov_rank=0, confidence_head_alpha=0.0, num_draft_layers=1),
}  # fmt: skip
SHARED = dict(block_size=4, mask_token_id=MASK_TOKEN_ID, num_anchors=NUM_ANCHORS)
# The Gemma 4 target's text config (a dict: DeepSpec's build_draft_config reads the target's config
# only): global (full-attention) heads of width 16 with proportional RoPE on a quarter of the
# dimensions, a final logit soft-cap small enough to bite on random logits.
GEMMA4_TEXT = dict(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    global_head_dim=16,
    num_global_key_value_heads=1,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    final_logit_softcapping=3.0,
    rope_parameters={
        "full_attention": {"rope_type": "proportional", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    },
    sliding_window=8,
    layer_types=["sliding_attention", "full_attention"] * 2,
    tie_word_embeddings=True,
    hidden_size_per_layer_input=0,
    pad_token_id=0,
    bos_token_id=2,
    eos_token_id=1,
)
# name -> (text-config overrides, DeepSpec model arguments beyond GEMMA4_SHARED).
GEMMA4_DRAFTERS = {
    "gemma4_keqv": (dict(attention_k_eq_v=True), dict(
        target_layer_ids=[0, 3], markov_rank=8, markov_head_type="vanilla", confidence_head_alpha=1.0,
        confidence_head_with_markov=True, num_draft_layers=2)),
    "gemma4_v": (dict(attention_k_eq_v=False), dict(
        target_layer_ids=[1, 2, 3], markov_rank=8, markov_head_type="gated", confidence_head_alpha=1.0,
        confidence_head_with_markov=False, num_draft_layers=1)),
}  # fmt: skip
GEMMA4_SHARED = dict(block_size=4, mask_token_id=4, num_anchors=NUM_ANCHORS)


class _Args(dict):
    """DeepSpec's model arguments: ``key in args`` and ``args.key``."""

    def __getattr__(self, k):
        try:
            return self[k]
        except KeyError:
            raise AttributeError(k) from None


def _randomize(model, gen, scale: float) -> None:
    """Seeded normal weights (norm gains ``1 + 0.1 N``) so that logits are far from uniform."""
    import torch

    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else scale * noise)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deepspec", required=True, help="a checkout of github.com/deepseek-ai/DeepSpec")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--only", choices=("gemma4",), help="write these fixtures alone, the others unchanged")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(args.deepspec).resolve()))
    if args.only == "gemma4":
        _gemma4(Path(args.out))
        return
    import importlib.util

    import numpy as np
    import torch
    import transformers
    from deepspec.modeling.dspark.common import extract_context_feature, sample_anchor_positions
    from deepspec.modeling.dspark.qwen3 import Qwen3DSparkModel, build_draft_config
    from transformers import Qwen3Config, Qwen3ForCausalLM

    spec = importlib.util.spec_from_file_location(
        "prepare_target_cache", Path(args.deepspec) / "scripts" / "data" / "prepare_target_cache.py"
    )
    assert spec is not None and spec.loader is not None
    cache_script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cache_script)

    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    gen = torch.Generator().manual_seed(SEED)
    tcfg = Qwen3Config(**TARGET, attn_implementation="eager")
    target = Qwen3ForCausalLM(tcfg).to(torch.float32).eval()
    _randomize(target, gen, 0.2)
    target.save_pretrained(out / "target")
    ids = torch.randint(0, MASK_TOKEN_ID, (1, SEQ_LEN), generator=gen)
    with torch.no_grad():
        hidden_states = target(ids, output_hidden_states=True).hidden_states
    made = {}
    for name, extra in DRAFTERS.items():
        cfg = build_draft_config(tcfg, _Args(SHARED, **extra))
        model = Qwen3DSparkModel(cfg).to(torch.float32).eval()
        _randomize(model, gen, 0.2)
        model.initialize_embeddings_and_head(embed_tokens=target.model.embed_tokens, lm_head=target.lm_head)
        model.save_pretrained(out / name)
        train_feats = cache_script.run_target_forward_with_hooks(
            target_model=target.model,
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            target_layer_ids=cfg.target_layer_ids,
        ).target_hidden_states
        eval_feats = extract_context_feature(hidden_states, cfg.target_layer_ids)
        loss_mask = torch.ones_like(ids, dtype=torch.float32)
        torch.manual_seed(SEED)
        anchors, keep = sample_anchor_positions(
            seq_len=SEQ_LEN, loss_mask=loss_mask, num_anchors=NUM_ANCHORS, device=ids.device
        )
        res = {}
        for kind, feats in (("train", train_feats), ("eval", eval_feats)):
            torch.manual_seed(SEED)  # the forward samples the same anchors again
            with torch.no_grad():
                res[kind] = model(ids, feats, loss_mask)
        conf = res["train"].confidence_pred
        np.savez_compressed(
            out / name / "reference.npz",
            input_ids=ids[0].numpy().astype(np.int32),
            anchors=anchors[0].numpy().astype(np.int32),
            eval_mask=res["train"].eval_mask[0].numpy(),
            draft_logits=res["train"].draft_logits[0].numpy().astype(np.float32),
            confidence_logits=np.zeros(0, np.float32) if conf is None else conf[0].numpy().astype(np.float32),
            eval_draft_logits=res["eval"].draft_logits[0].numpy().astype(np.float32),
        )
        assert bool(keep.all()), "every anchor is valid with a full loss mask"
        made[name] = {"target_layer_ids": list(cfg.target_layer_ids), **extra}
    (out / "manifest.json").write_text(
        json.dumps(
            {
                "made_by": "tests/data/make_deepspec_fixtures.py",
                "seed": SEED,
                "seq_len": SEQ_LEN,
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "drafters": made,
            },
            indent=1,
        )
    )


def _gemma4(out: Path) -> None:
    """The Gemma 4 drafters (``--only gemma4``; module doc), added to ``out/manifest.json``."""
    import numpy as np
    import torch
    import transformers
    from deepspec.modeling.dspark.common import sample_anchor_positions
    from deepspec.modeling.dspark.gemma4 import Gemma4DSparkModel, build_draft_config
    from transformers import Gemma4Config

    gen = torch.Generator().manual_seed(SEED + 4)
    made = {}
    for name, (text_extra, extra) in GEMMA4_DRAFTERS.items():
        tcfg = Gemma4Config(text_config={**GEMMA4_TEXT, **text_extra})
        cfg = build_draft_config(tcfg, _Args(GEMMA4_SHARED, **extra))
        model = Gemma4DSparkModel(cfg).to(torch.float32).eval()
        _randomize(model, gen, 0.2)
        rope = model.rotary_emb.full_attention_inv_freq
        hd, angles = cfg.global_head_dim, int(0.25 * cfg.global_head_dim // 2)
        want = 1.0 / 10000.0 ** (torch.arange(0, 2 * angles, 2, dtype=torch.float32) / hd)
        assert torch.equal(rope[:angles], want) and not rope[angles:].any(), "proportional RoPE over global_head_dim"
        with torch.no_grad():  # a layer scalar that is not 1 (a buffer DeepSpec saves)
            for i, layer in enumerate(model.layers):
                layer.layer_scalar.fill_(1.0 + 0.25 * (i + 1))
        d = out / name
        if d.exists():
            shutil.rmtree(d)
        model.save_pretrained(d)
        ids = torch.randint(0, GEMMA4_TEXT["vocab_size"], (1, SEQ_LEN), generator=gen)
        feats = torch.randn((1, SEQ_LEN, len(cfg.target_layer_ids) * cfg.hidden_size), generator=gen)
        loss_mask = torch.ones_like(ids, dtype=torch.float32)
        torch.manual_seed(SEED)
        anchors, keep = sample_anchor_positions(
            seq_len=SEQ_LEN, loss_mask=loss_mask, num_anchors=NUM_ANCHORS, device=ids.device
        )
        torch.manual_seed(SEED)  # the forward samples the same anchors again
        with torch.no_grad():
            res = model(ids, feats, loss_mask)
        assert bool(keep.all()), "every anchor is valid with a full loss mask"
        np.savez_compressed(
            d / "reference.npz",
            input_ids=ids[0].numpy().astype(np.int32),
            features=feats[0].numpy().astype(np.float32),
            anchors=anchors[0].numpy().astype(np.int32),
            eval_mask=res.eval_mask[0].numpy(),
            draft_logits=res.draft_logits[0].numpy().astype(np.float32),
            confidence_logits=res.confidence_pred[0].numpy().astype(np.float32),
        )
        made[name] = {"text_config": text_extra, "target_layer_ids": list(cfg.target_layer_ids), **extra}
    manifest = out / "manifest.json"
    m = json.loads(manifest.read_text()) if manifest.exists() else {}
    m["gemma4"] = {
        "seed": SEED + 4,
        "target_text_config": GEMMA4_TEXT,
        "shared": GEMMA4_SHARED,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "drafters": made,
    }
    manifest.write_text(json.dumps(m, indent=1))


if __name__ == "__main__":
    main()
