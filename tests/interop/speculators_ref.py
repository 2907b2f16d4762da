"""Reference outputs of speculators' DSpark drafter (``speculators`` 0.9.0) on tiny random models.

The numbers come from speculators' own code: the drafter is built with
``DSparkDraftModel.from_training_args`` (the trainer's constructor), saved with its own
``save_pretrained``, and run with its own training ``forward``. Only two things are swapped while
it runs (:func:`speculators_block_outputs`): ``select_anchors`` (random in speculators) returns the
anchors given here, and ``compute_metrics`` (the loss) records its inputs instead of computing a
loss. Nothing downloads; everything is CPU, float32 and eager attention, and runs in seconds.

Install (speculators' pins clash with this project's: transformers <= 5.19, torchvision,
torchaudio)::

    pip install --no-deps speculators==0.9.0 "datasets==5.1.0" "multiprocess<0.70.20" \
        "dill>=0.3.0,<0.4.2" xxhash pyarrow pandas hs-connectors==0.9.0 "loguru>=0.7.2,<=0.7.3"

Conventions found in speculators 0.9.0 (file names relative to ``speculators/``):

* Features: ``hidden_states`` = the target's residual streams at ``aux_hidden_state_layer_ids``,
  concatenated along the last axis **in that list's order** -> ``[1, T, n*H]``
  (``train/data.py``: ``hidden_states[:, :-1].flatten(1)``). Index ``i`` is HF
  ``output_hidden_states`` index ``i`` (0 = embedding output, ``i`` = output of decoder layer
  ``i-1``). ``verifier_last_hidden_states`` is the output of the **last decoder layer before the
  final norm** (speculators applies its own ``verifier_norm``). In transformers 5.x HF's
  ``hidden_states[L]`` is *after* the final norm, so :func:`target_features` takes index ``L``
  from a hook on the last layer instead (what vLLM's hidden-state extraction gives).
* Block of anchor ``p``: ids ``[x_p, m, ..., m]`` (``m = mask_token_id``) embedded with the frozen
  verifier table (``embed_tokens`` = the target's ``model.embed_tokens``), so a mask slot is
  ``E[mask_token_id]``. RoPE positions: context ``0..T-1``, block ``p..p+B-1``. Attention
  (``models/dflash/attention.py``): a block query sees context positions ``< p`` (same document)
  and all ``B`` slots of its own block (bidirectional for full-attention layers). Context K/V =
  ``k_proj/v_proj(hidden_norm(fc(features)))`` (no input_layernorm), ``k_norm`` on context and
  block keys, ``q_norm`` on queries, then RoPE (``models/dflash/model_definitions.py``).
* Logits: ``lm_head(norm(h))`` (``lm_head`` = target rows ``t2d``) plus the Markov bias
  ``block_bias(prev)``; ``sample_from_anchor=True``: slot ``k`` predicts token ``p+k+1`` and its
  Markov prev is token ``p+k`` (slot 0: the anchor), teacher-forced; the rnn state starts at 0
  in slot 0. ``False``: slot ``k`` predicts ``p+k``, prev = token ``p+k-1`` (slot 0's prev = the
  anchor; slot 0 loss-masked).
* Confidence: ``proj([h; W1[prev]])`` with the **raw** ``markov_w1`` row for every head type
  (``[h]`` alone when ``confidence_head_with_markov=False``), pre-sigmoid logit per slot.
* Draft vocabulary: ``d2t[i] = ids[i] - i`` (target id = ``i + d2t[i]``, ids ascending),
  ``t2d`` = bool mask over the target vocabulary; ``lm_head``/verifier targets are the target
  rows ``t2d`` (``model.py``, ``train/vocab_mapping.py``).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import numpy as np

SPECULATORS_VERSION = "0.9.0"
HEAD_TYPES = ("vanilla", "gated", "rnn")

# ----------------------------------------------------------------------------- the target


def write_tiny_tokenizer(path: str | Path, vocab_size: int) -> Path:
    """A WordLevel tokenizer with exactly ``vocab_size`` tokens (``<unk> <s> </s> w3 w4 ...``,
    BOS 1, EOS 2) so that ``dspark_jax``'s ``load_target`` (``HFTokenizer``:
    ``AutoTokenizer.from_pretrained``) accepts the directory; ``load_hf_dir`` needs none."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(3, vocab_size)]
    t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(str(path))
    return Path(path)


def _randomize(module, seed: int, scale: float, skip: tuple[str, ...] = (), overrides: dict | None = None) -> None:
    """Seeded in-place re-initialisation of every parameter not named in ``skip`` (a prefix):
    norm gains ``1 + 0.1 N(0,1)``, everything else ``scale * N(0,1)`` (``overrides`` maps a name
    suffix to its own scale). Parameter order is the module's (deterministic)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.startswith(skip):
                continue
            z = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if "norm" in name.split(".")[-2] and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * z)
            else:
                s = next((v for k, v in (overrides or {}).items() if name.endswith(k)), scale)
                p.copy_(s * z)


def make_tiny_qwen3_target(
    tmpdir: str | Path,
    seed: int = 0,
    *,
    vocab_size: int = 256,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    max_position: int = 256,
    rope_theta: float = 10000.0,
    rms_norm_eps: float = 1e-6,
    tie_word_embeddings: bool = False,
    scale: float = 0.1,
    tokenizer: bool = True,
):
    """A tiny random ``Qwen3ForCausalLM`` (float32, eager attention) saved with
    ``save_pretrained`` (``model.safetensors``, tensors ``model.embed_tokens.weight``,
    ``model.layers.{i}.*``, ``model.norm.weight``, ``lm_head.weight`` unless tied) in
    ``tmpdir/target``, plus a tokenizer of the same size (:func:`write_tiny_tokenizer`).

    Weights: seeded normal, ``scale`` (norm gains ``1 + 0.1 N``), so hidden states and logits
    are far from uniform. Returns ``(path, model)`` with the model in eval mode.
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position,
        rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta)},
        rms_norm_eps=rms_norm_eps,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg).to(torch.float32)
    _randomize(model, seed, scale)
    if tie_word_embeddings:
        model.tie_weights()
    model.eval()
    path = Path(tmpdir) / "target"
    model.save_pretrained(str(path))
    if tokenizer:
        write_tiny_tokenizer(path, vocab_size)
    return path, model


def target_features(target, input_ids, aux_ids: list[int]) -> dict[str, Any]:
    """Runs the transformers target and returns speculators' training inputs (torch, float32):

    * ``hidden_states``: ``[1, T, n*H]``, streams ``aux_ids`` concatenated in that order
      (index ``L`` = last layer output *before* the final norm);
    * ``verifier_last_hidden_states``: ``[1, T, H]``, the last layer's output before the norm;
    * ``hf_hidden_states``: HF's tuple (``L+1`` entries; entry ``L`` is post-norm in 5.x);
    * ``logits``: ``[1, T, V]`` target logits.
    """
    import torch

    ids = torch.as_tensor(np.asarray(input_ids), dtype=torch.long).reshape(1, -1)
    layers = target.model.layers
    seen: list = []
    hook = layers[-1].register_forward_hook(lambda m, i, o: seen.append(o[0] if isinstance(o, tuple) else o))
    try:
        with torch.no_grad():
            out = target(input_ids=ids, output_hidden_states=True)
    finally:
        hook.remove()
    last = seen[-1].float()
    streams = [*out.hidden_states[: len(layers)], last]
    for i in aux_ids:
        if not 0 <= i <= len(layers):
            raise ValueError(f"aux id {i} outside [0, {len(layers)}]")
    feats = torch.cat([streams[i].float() for i in aux_ids], dim=-1)
    return {
        "hidden_states": feats,
        "verifier_last_hidden_states": last,
        "hf_hidden_states": out.hidden_states,
        "logits": out.logits.float(),
    }


# ----------------------------------------------------------------------------- the drafter


def _draft_layer_config(target_cfg, num_layers: int, intermediate_size: int | None):
    """The draft ``transformer_layer_config``, as speculators' ``create_transformer_layer_config``
    builds it for a Qwen3 verifier (``train/cli.py``; not imported: it needs the CLI's
    dependencies): the verifier's shapes, ``num_hidden_layers`` = draft depth, all full
    attention, untied, the verifier's ``rope_parameters``."""
    from transformers import Qwen3Config

    c = Qwen3Config(
        vocab_size=target_cfg.vocab_size,
        hidden_size=target_cfg.hidden_size,
        intermediate_size=intermediate_size or target_cfg.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=target_cfg.num_attention_heads,
        num_key_value_heads=target_cfg.num_key_value_heads,
        hidden_act=target_cfg.hidden_act,
        max_position_embeddings=target_cfg.max_position_embeddings,
        initializer_range=target_cfg.initializer_range,
        rms_norm_eps=target_cfg.rms_norm_eps,
        head_dim=target_cfg.head_dim,
        tie_word_embeddings=False,
        layer_types=["full_attention"] * num_layers,
    )
    c.rope_parameters = dict(target_cfg.rope_parameters)
    return c


def random_draft_vocab(vocab_size: int, draft_vocab_size: int, seed: int):
    """``(ids, d2t, t2d)`` of a random draft vocabulary: ``ids`` ascending target ids,
    ``d2t = ids - arange(N)`` (int64 offsets), ``t2d`` bool ``[V]`` (speculators'
    ``build_vocab_mappings_from_distribution`` layout)."""
    import torch

    rng = np.random.default_rng(seed)
    ids = np.sort(rng.choice(vocab_size, size=draft_vocab_size, replace=False)).astype(np.int64)
    d2t = torch.as_tensor(ids - np.arange(draft_vocab_size), dtype=torch.long)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[torch.as_tensor(ids)] = True
    return ids, d2t, t2d


def _quiet_speculators() -> None:
    """Silences speculators' loguru INFO/WARNING lines ("Loading from local directory")."""
    from loguru import logger

    logger.disable("speculators")


def make_tiny_speculators_dspark(
    target_path: str | Path,
    tmpdir: str | Path,
    seed: int = 0,
    *,
    block_size: int = 4,
    aux_hidden_state_layer_ids: list[int] | None = None,
    markov_rank: int = 8,
    markov_head_type: str = "vanilla",
    draft_vocab_size: int | None = None,
    num_layers: int = 1,
    sample_from_anchor: bool = True,
    mask_token_id: int | None = None,
    enable_confidence_head: bool = True,
    confidence_head_with_markov: bool | None = None,
    intermediate_size: int | None = None,
    scale: float = 0.1,
    markov_w1_scale: float = 1.0,
    name: str = "dspark",
):
    """A speculators ``DSparkDraftModel`` with random weights, saved by its ``save_pretrained``.

    Built by ``DSparkDraftModel.from_training_args`` (which reads the target's ``config.json``
    and loads ``embed_tokens``/``lm_head``/``verifier_norm`` from its safetensors), then every
    trainable parameter is re-drawn (:func:`_randomize`, ``seed + 1``): ``scale`` for matrices
    and biases, ``markov_w1_scale`` for ``markov_w1``, ``1 + 0.1 N`` for norm gains; nothing is
    left at zero (the Markov W2, gate/joint biases, confidence bias included).

    Args:
      target_path: a directory from :func:`make_tiny_qwen3_target` (speculators reads it).
      aux_hidden_state_layer_ids: HF hidden-state indices (default ``[1, L//2, L-1]``).
      draft_vocab_size: ``None`` = the full vocabulary (``N = V``), else a random ascending
        subset (:func:`random_draft_vocab`, ``seed``).
      mask_token_id: default ``V - 1``.
      confidence_head_with_markov: default ``markov_rank > 0``.
    Returns:
      ``(path, model)``: ``tmpdir/name`` and the model (eval mode, eager attention); the draft
      vocabulary's ids are ``model.draft_ids`` (``None`` for the full vocabulary).
    """
    import torch
    from speculators.models.dspark import DSparkDraftModel
    from transformers import AutoConfig

    _quiet_speculators()
    target_path = Path(target_path)
    tcfg = AutoConfig.from_pretrained(str(target_path), local_files_only=True)
    v, n_layers = tcfg.vocab_size, tcfg.num_hidden_layers
    n = v if draft_vocab_size is None else draft_vocab_size
    ids, d2t, t2d = random_draft_vocab(v, n, seed) if n != v else (None, None, None)
    torch.manual_seed(seed)
    model = DSparkDraftModel.from_training_args(
        _draft_layer_config(tcfg, num_layers, intermediate_size),
        t2d=t2d,
        d2t=d2t,
        verifier_name_or_path=str(target_path),
        target_layer_ids=list(aux_hidden_state_layer_ids or [1, n_layers // 2, n_layers - 1]),
        draft_vocab_size=n,
        block_size=block_size,
        mask_token_id=v - 1 if mask_token_id is None else mask_token_id,
        sample_from_anchor=sample_from_anchor,
        markov_rank=markov_rank,
        markov_head_type=markov_head_type,
        enable_confidence_head=enable_confidence_head,
        confidence_head_with_markov=markov_rank > 0
        if confidence_head_with_markov is None
        else confidence_head_with_markov,
        draft_attn_impl="eager",
    ).to(torch.float32)
    frozen = ("embed_tokens", "lm_head", "verifier_lm_head", "verifier_norm")
    _randomize(model, seed + 1, scale, skip=frozen, overrides={"markov_w1.weight": markov_w1_scale})
    model.eval()
    model.draft_ids = ids
    path = Path(tmpdir) / name
    model.save_pretrained(str(path))
    return path, model


def load_speculators_dspark(path: str | Path):
    """Reloads a saved drafter with speculators' ``from_pretrained`` (verifier weights from
    ``speculators_config.verifier.name_or_path``), eager attention, eval mode. The draft ids
    (``model.draft_ids``) are rebuilt from the loaded ``d2t``."""
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig

    _quiet_speculators()
    cfg = DSparkSpeculatorConfig.from_pretrained(str(path))
    cfg.transformer_layer_config._attn_implementation = "eager"  # the default would be flex attention
    model = DSparkDraftModel.from_pretrained(str(path), config=cfg).eval()
    model.draft_ids = None if model.d2t is None else (model.d2t.numpy() + np.arange(model.d2t.shape[0]))
    return model


def saved_listing(path: str | Path) -> tuple[dict, dict[str, tuple[tuple[int, ...], str]]]:
    """``(config.json as a dict, {tensor name: (shape, safetensors dtype)})`` of a saved
    directory, read from the safetensors headers (no torch)."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        tensors.update({k: (tuple(v["shape"]), v["dtype"]) for k, v in header.items() if k != "__metadata__"})
    return config, dict(sorted(tensors.items()))


# ----------------------------------------------------------------------------- block outputs


@contextlib.contextmanager
def _forced_anchors_and_capture(model, anchors, rec: dict):
    """Patches speculators for one forward: ``select_anchors`` -> the given anchors (all valid),
    ``compute_metrics`` -> record ``logits/targets/confidence_logits/loss_mask``, and wraps the
    instance's ``_backbone_forward`` and ``markov_head.block_bias`` to record their values."""
    from unittest import mock

    import speculators.models.dflash.core as dflash_core
    import speculators.models.dspark.core as dspark_core
    import torch

    a = torch.as_tensor(anchors, dtype=torch.long)

    def select_anchors(loss_mask, num_anchors, block_size):
        assert num_anchors == a.numel()
        return a.to(loss_mask.device), torch.ones(a.numel(), dtype=torch.bool, device=loss_mask.device)

    def compute_metrics(logits, targets, confidence_logits, loss_mask, block_size, **kw):
        rec.update(logits=logits, targets=targets, confidence_logits=confidence_logits, loss_mask=loss_mask)
        return torch.zeros(()), {}

    orig_backbone = model._backbone_forward

    def backbone(*args, **kw):
        out = orig_backbone(*args, **kw)
        rec.update(hidden=out[0], base_logits=out[1], block_indices=out[4])
        return out

    patches = [
        mock.patch.object(dflash_core, "select_anchors", select_anchors),
        mock.patch.object(dspark_core, "compute_metrics", compute_metrics),
        mock.patch.object(model, "_backbone_forward", backbone),
    ]
    head = model.markov_head
    if head is not None:
        orig_bias = head.block_bias

        def block_bias(**kw):
            rec["prev_token_ids"] = kw["prev_token_ids"]
            return orig_bias(**kw)

        patches.append(mock.patch.object(head, "block_bias", block_bias))
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        yield


def _as_features(hidden_states):
    """``[1, T, n*H]`` float32 from a tensor/array (``[T, n*H]`` or ``[1, T, n*H]``) or a list of
    per-tap ``[.., T, H]`` streams (concatenated in list order)."""
    import torch

    if isinstance(hidden_states, (list, tuple)):
        hidden_states = torch.cat([torch.as_tensor(np.asarray(h), dtype=torch.float32) for h in hidden_states], -1)
    h = torch.as_tensor(np.asarray(hidden_states) if not torch.is_tensor(hidden_states) else hidden_states)
    h = h.to(torch.float32)
    return h.reshape(1, *h.shape[-2:])


def to_target_ids(model, draft_local_ids):
    """Draft-vocabulary indices -> target ids (``i + d2t[i]``, vLLM's ``map_draft_to_target``);
    identity for the full vocabulary."""
    x = np.asarray(draft_local_ids)
    if getattr(model, "d2t", None) is None:
        return x
    return x + model.d2t.numpy()[x]


def speculators_block_outputs(
    model,
    hidden_states,
    input_ids,
    anchors,
    verifier_last_hidden_states=None,
) -> dict[str, np.ndarray | None]:
    """Teacher-forced block outputs of speculators' DSpark training forward at fixed anchors.

    Args:
      model: a ``DSparkDraftModel`` (eager attention: :func:`make_tiny_speculators_dspark` or
        :func:`load_speculators_dspark`).
      hidden_states: the features (see :func:`_as_features`; :func:`target_features` gives them).
      input_ids: the ``T`` token ids (one document, positions ``0..T-1``).
      anchors: anchor positions ``p``, each ``0 <= p <= T-1-block_size`` (speculators' own
        range: the last ``block_size`` positions are never anchors).
      verifier_last_hidden_states: ``[1, T, H]`` pre-norm last-layer output; None: zeros, and
        the ``target_*`` outputs are None.
    Returns:
      numpy arrays (``A`` anchors, ``B = block_size``, ``N`` = draft vocabulary):
      ``logits [A,B,N]`` after the Markov bias; ``base_logits`` before it; ``markov_bias``;
      ``confidence_logits [A,B]`` (pre-sigmoid; None without the head) and ``confidences``;
      ``labels [A,B]`` the token each slot predicts (``p+k+1``; ``p+k`` if not
      ``sample_from_anchor``); ``positions [A,B]`` = ``p+k`` (RoPE positions of the slots);
      ``prev_token_ids [A,B]`` the Markov prev tokens; ``loss_mask [A,B]``; ``draft_local``
      argmax of ``logits`` in the draft vocabulary and ``draft_ids`` mapped to target ids;
      ``hidden [A,B,d]`` the post-norm block states; ``target_logits [A,B,N]`` the verifier
      logits speculators distils each slot towards and ``target_ids`` their argmax (target ids).
    """
    import torch

    ids = torch.as_tensor(np.asarray(input_ids), dtype=torch.long).reshape(1, -1)
    t, b = ids.shape[1], model.block_size
    anchors = [int(p) for p in anchors]
    if not anchors or any(not 0 <= p <= t - 1 - b for p in anchors):
        raise ValueError(f"anchors {anchors} must lie in [0, {t - 1 - b}] (T={t}, block_size={b})")
    feats = _as_features(hidden_states)
    last = verifier_last_hidden_states
    last = torch.zeros(1, t, model.hidden_size) if last is None else _as_features(last)
    rec: dict = {}
    with torch.no_grad(), _forced_anchors_and_capture(model, anchors, rec):
        model(
            hidden_states=feats,
            input_ids=ids,
            loss_mask=torch.ones(1, t, dtype=torch.long),
            verifier_last_hidden_states=last,
            document_ids=torch.zeros(1, t, dtype=torch.long),
            max_anchors=len(anchors),
        )
    a = len(anchors)
    shape = (a, b)
    np_ = lambda x: None if x is None else x.detach().float().reshape(*shape, -1).squeeze(-1).numpy()
    logits, base = np_(rec["logits"]), np_(rec["base_logits"])
    idx = rec["block_indices"].reshape(shape).numpy()
    sfa = model.config.sample_from_anchor
    prev = rec.get("prev_token_ids")
    if prev is None:  # no Markov head: speculators' convention, for reference only
        blk = ids[0].numpy()[idx]
        prev = blk if sfa else np.concatenate([blk[:, :1], blk[:, :-1]], 1)
    conf = np_(rec["confidence_logits"])
    targets = np_(rec["targets"]) if verifier_last_hidden_states is not None else None
    draft_local = logits.argmax(-1)
    return {
        "anchors": np.asarray(anchors),
        "positions": idx,
        "logits": logits,
        "base_logits": base,
        "markov_bias": logits - base,
        "confidence_logits": conf,
        "confidences": None if conf is None else 1.0 / (1.0 + np.exp(-conf)),
        "labels": ids[0].numpy()[idx + 1 if sfa else idx],
        "prev_token_ids": np.asarray(prev),
        "loss_mask": rec["loss_mask"].reshape(shape).numpy(),
        "draft_local": draft_local,
        "draft_ids": to_target_ids(model, draft_local),
        "hidden": np_(rec["hidden"]),
        "target_logits": targets,
        "target_ids": None if targets is None else to_target_ids(model, targets.argmax(-1)),
    }


# ----------------------------------------------------------------------------- self-check


def _self_check(tmp: Path) -> None:
    import time

    import torch

    t0 = time.perf_counter()
    torch.use_deterministic_algorithms(True)
    tpath, target = make_tiny_qwen3_target(tmp, seed=0)
    print(f"target {tpath}: {sorted(p.name for p in tpath.iterdir())}")
    ids = np.random.default_rng(0).integers(3, 255, size=24)
    aux = [1, 2, 4]
    feats = target_features(target, ids, aux)
    assert torch.equal(feats["hf_hidden_states"][1], feats["hidden_states"][..., :64])
    anchors = [3, 9, 14]
    for head, n in [("vanilla", None), ("gated", None), ("rnn", None), ("vanilla", 100)]:
        t1 = time.perf_counter()
        path, model = make_tiny_speculators_dspark(
            tpath, tmp, seed=1, markov_head_type=head, draft_vocab_size=n, aux_hidden_state_layer_ids=aux,
            name=f"dspark_{head}_{n}",
        )  # fmt: skip
        out = speculators_block_outputs(
            model, feats["hidden_states"], ids, anchors, feats["verifier_last_hidden_states"]
        )
        again = speculators_block_outputs(
            load_speculators_dspark(path), feats["hidden_states"], ids, anchors, feats["verifier_last_hidden_states"]
        )
        assert all(np.array_equal(out[k], again[k]) for k in out if out[k] is not None), "save/load changed outputs"
        changed = (out["draft_local"] != out["base_logits"].argmax(-1)).mean()
        print(f"\n== {head}, draft_vocab_size={n}: {time.perf_counter() - t1:.2f} s, Markov changes {changed:.0%}")
        for k, v in out.items():
            print(f"  {k}: {None if v is None else v.shape}")
        print("  labels", out["labels"].tolist(), "\n  prev", out["prev_token_ids"].tolist())
        print("  draft_ids", out["draft_ids"].tolist(), "\n  confidences", np.round(out["confidences"], 3).tolist())
        config, tensors = saved_listing(path)
        print("  config.json keys:", sorted(config))
        print("  transformer_layer_config:", json.dumps(config["transformer_layer_config"], sort_keys=True))
        skeys = ("draft_vocab_size", "block_size", "aux_hidden_state_layer_ids", "mask_token_id", "markov_rank")
        print("  values:", {k: config[k] for k in skeys + ("markov_head_type", "sample_from_anchor")})
        print("  speculators_config:", json.dumps(config["speculators_config"]))
        for name, (shape, dtype) in tensors.items():
            print(f"    {name} {list(shape)} {dtype}")
    print(f"\nself-check {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        _self_check(Path(d))
