"""Mixture-of-experts targets (Qwen3-MoE, Mixtral) against transformers, on tiny random fp32 models
transformers itself writes (eager):

* a ``qwen3_moe`` directory with dense and sparse layers mixed (``mlp_only_layers``), with
  ``norm_topk_prob`` both ways: logits within 1e-4 through the cache-less pass, the cached
  prefill (grouped expert products) and cached verification-sized / one-token steps (the chosen
  experts' weights gathered);
* a Mixtral GGUF (architecture ``llama`` with ``llama.expert_count``) written with the ``gguf``
  package as llama.cpp's converter writes it, against ``MixtralForCausalLM`` on the same weights;
* greedy speculative decoding equals plain decoding, the serving engine (one-shot and chunked
  prefill, packed steps) equals plain decoding, and a drafter for the MoE target trains a few
  steps and then decodes exactly;
* what the loaders do not implement is refused by name.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from dspark_jax.decoding.speculative import generate_autoregressive, generate_speculative
from dspark_jax.errors import DSparkInputError
from dspark_jax.models.gguf_io import load_gguf
from dspark_jax.models.hf_io import load_hf_dir
from dspark_jax.models.target import Target
from dspark_jax.models.weights import count_target_params, params_fingerprint
from tests.helpers.drafters import assert_same_outputs, bigram_drafter, random_drafter
from tests.helpers.engine_drive import chunked_engine, drive
from tests.helpers.tiny import cached_logits, hf_logits

pytestmark = pytest.mark.exactness

TOL = 1e-4
VOCAB, HIDDEN, HEADS, KV, HD, EXPERTS, TOPK, SEQ = 128, 32, 4, 2, 8, 8, 2, 24
COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=HD,
              max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False, num_experts_per_tok=TOPK, attn_implementation="eager")  # fmt: skip


def _perturb(model):
    """Non-trivial norms and a sharper router, so that a mis-mapped norm or expert shows up."""
    import torch

    with torch.no_grad():
        for n, prm in model.named_parameters():
            if "norm" in n:
                prm.copy_(1.0 + 0.3 * torch.randn_like(prm))
            elif n.endswith("mlp.gate.weight"):
                prm.mul_(20.0)


def make_qwen3_moe(path, norm_topk_prob: bool, seed: int = 0):
    """3 layers: 0 and 2 sparse (8 experts, top 2), 1 dense (``mlp_only_layers``)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(**COMMON, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
                         num_experts=EXPERTS, decoder_sparse_step=1, mlp_only_layers=[1],
                         norm_topk_prob=norm_topk_prob, initializer_range=0.1)  # fmt: skip
    model = Qwen3MoeForCausalLM(cfg)
    _perturb(model)
    model.save_pretrained(path)
    return model.float().eval()


def jax_logits(cfg, params, ids: np.ndarray) -> np.ndarray:
    """Full causal forward [T, V], checked against the cached path (prefill 12, then 3, 1, the rest)."""
    return cached_logits(Target(cfg, params), ids, (12, 3, 1, len(ids) - 16), TOL)[0]


def tokens(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, SEQ).astype(np.int32)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    """``get(norm_topk_prob)`` -> (transformers model, directory), each written once."""
    made = {}

    def get(norm: bool):
        if norm not in made:
            path = tmp_path_factory.mktemp(f"qwen3moe-{norm}")
            made[norm] = (make_qwen3_moe(path, norm), path)
        return made[norm]

    return get


@pytest.mark.parametrize("norm", [False, True])
def test_hf_qwen3_moe_matches_transformers(qwen3_moe, norm):
    model, path = qwen3_moe(norm)
    cfg, params = load_hf_dir(path)
    assert cfg.sparse_layers() == (True, False, True) and cfg.norm_topk_prob == norm and cfg.mixed_mlp
    assert params["layers"]["moe_gate"].shape == (2, EXPERTS, HIDDEN, 16)
    assert params["layers"]["w_gate"].shape == (1, HIDDEN, 48)
    ids = tokens()
    want, got = hf_logits(model, ids), jax_logits(cfg, params, ids)
    assert np.abs(want).max() > 0.5, "logits too flat for the comparison to mean anything"
    assert np.abs(got - want).max() <= TOL, np.abs(got - want).max()
    n_total = sum(p.numel() for p in model.parameters())
    assert count_target_params(cfg) == n_total
    per_expert = 3 * HIDDEN * 16
    assert count_target_params(cfg, active=True) == n_total - 2 * (EXPERTS - TOPK) * per_expert


def test_all_sparse_layers_are_scanned_directly(qwen3_moe, tmp_path):
    """Every layer sparse (no dense stack, experts in the scanned per-layer weights) still matches."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(2)
    cfg = Qwen3MoeConfig(**COMMON, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
                         num_experts=EXPERTS, norm_topk_prob=True)  # fmt: skip
    model = Qwen3MoeForCausalLM(cfg)
    _perturb(model)
    model.save_pretrained(tmp_path)
    cfg, params = load_hf_dir(tmp_path)
    assert not cfg.mixed_mlp and "w_gate" not in params["layers"]
    ids = tokens(3)
    got, want = jax_logits(cfg, params, ids), hf_logits(model.float().eval(), ids)
    assert np.abs(got - want).max() <= TOL, np.abs(got - want).max()


# ----------------------------------------------------------------------------- Mixtral GGUF


def write_moe_gguf(model, path, arch: str = "llama"):
    """``MixtralForCausalLM`` (``arch="llama"``) or an all-sparse ``Qwen3MoeForCausalLM``
    (``"qwen3moe"``) as an F32 GGUF the way convert_hf_to_gguf.py writes them: ``{arch}.expert_count``
    / ``expert_used_count`` (qwen3moe: ``expert_feed_forward_length``), llama's q/k rows permuted to
    adjacent pairs (qwen3moe: half rotation kept, q/k norms), ``ffn_gate_inp`` (router) and each
    projection's experts stacked as ``ffn_{gate,up,down}_exps``."""
    import gguf

    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_key_length(HD)
    w.add_value_length(HD)
    w.add_expert_count(c.num_local_experts if arch == "llama" else c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    if arch == "qwen3moe":
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_vocab_size(c.vocab_size)
    w.add_rope_dimension_count(HD)
    sd = {k: v.float().numpy() for k, v in model.state_dict().items()}

    def permute(m, n):  # LlamaModel.permute: half-rotation rows -> adjacent pairs
        return m.reshape(n, 2, m.shape[0] // n // 2, *m.shape[1:]).swapaxes(1, 2).reshape(m.shape)

    im = c.intermediate_size if arch == "llama" else c.moe_intermediate_size
    qk = permute if arch == "llama" else (lambda m, n: m)
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(c.num_hidden_layers):
        pre = f"model.layers.{i}."
        gate_up, down = (
            sd[pre + "mlp.experts.gate_up_proj"],
            sd[pre + "mlp.experts.down_proj"],
        )  # [E, 2Im, H], [E, H, Im]
        tensors = {
            "attn_norm": sd[pre + "input_layernorm.weight"],
            "attn_q": qk(sd[pre + "self_attn.q_proj.weight"], c.num_attention_heads),
            "attn_k": qk(sd[pre + "self_attn.k_proj.weight"], c.num_key_value_heads),
            "attn_v": sd[pre + "self_attn.v_proj.weight"],
            "attn_output": sd[pre + "self_attn.o_proj.weight"],
            "ffn_norm": sd[pre + "post_attention_layernorm.weight"],
            "ffn_gate_inp": sd[pre + "mlp.gate.weight"],
            "ffn_gate_exps": gate_up[:, :im],
            "ffn_up_exps": gate_up[:, im:],
            "ffn_down_exps": down,
        }
        if arch == "qwen3moe":
            tensors.update(
                attn_q_norm=sd[pre + "self_attn.q_norm.weight"], attn_k_norm=sd[pre + "self_attn.k_norm.weight"]
            )
        for name, t in tensors.items():
            w.add_tensor(f"blk.{i}.{name}.weight", np.ascontiguousarray(t))
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(1)
    cfg = MixtralConfig(**COMMON, intermediate_size=24, num_hidden_layers=2, num_local_experts=EXPERTS,
                        initializer_range=0.1)  # fmt: skip
    model = MixtralForCausalLM(cfg)
    _perturb(model)
    return model.float().eval(), write_moe_gguf(model, tmp_path_factory.mktemp("mixtral") / "m.gguf")


def test_mixtral_gguf_matches_transformers(mixtral):
    """Before experts were read this file failed with "lacks tensor 'blk.0.ffn_gate.weight'"."""
    model, path = mixtral
    cfg, params = load_gguf(path)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == (EXPERTS, TOPK, True)
    ids = tokens(1)
    want, got = hf_logits(model, ids), jax_logits(cfg, params, ids)
    assert np.abs(got - want).max() <= TOL, np.abs(got - want).max()


def test_qwen3moe_gguf_matches_transformers(tmp_path):
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(4)
    cfg = Qwen3MoeConfig(**COMMON, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
                         num_experts=EXPERTS, norm_topk_prob=True, initializer_range=0.1)  # fmt: skip
    model = Qwen3MoeForCausalLM(cfg)
    _perturb(model)
    tcfg, params = load_gguf(write_moe_gguf(model, tmp_path / "q.gguf", arch="qwen3moe"))
    assert tcfg.qk_norm and (tcfg.moe_intermediate_size, tcfg.num_experts) == (16, EXPERTS)
    ids = tokens(2)
    want, got = hf_logits(model.float().eval(), ids), jax_logits(tcfg, params, ids)
    assert np.abs(got - want).max() <= TOL, np.abs(got - want).max()


# ----------------------------------------------------------------------------- refusals


def test_loaders_refuse_what_they_do_not_implement(qwen3_moe, mixtral, tmp_path):
    import gguf

    path = tmp_path / "m"
    shutil.copytree(qwen3_moe(True)[1], path)
    c = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**c, "use_sliding_window": True, "sliding_window": 8}))
    with pytest.raises(DSparkInputError, match="sliding-window attention"):
        load_hf_dir(path)
    # A GGUF MoE key this loader does not read (e.g. shared experts) is refused by name.
    reader = gguf.GGUFReader(str(mixtral[1]))
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "llama")
    for f in reader.fields.values():
        if f.name.startswith("llama.") and f.types[0] == gguf.GGUFValueType.UINT32:
            w.add_uint32(f.name, int(f.contents()))
        elif f.name.startswith("llama.") and f.types[0] == gguf.GGUFValueType.FLOAT32:
            w.add_float32(f.name, float(f.contents()))
    w.add_uint32("llama.expert_shared_count", 1)
    for t in reader.tensors:
        w.add_tensor(t.name, np.asarray(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(DSparkInputError, match="llama.expert_shared_count is not supported"):
        load_gguf(tmp_path / "x.gguf")


# ----------------------------------------------------------------------------- decoding, serving, training


@pytest.fixture(scope="module")
def moe_target(qwen3_moe):
    cfg, params = load_hf_dir(qwen3_moe(True)[1])
    return Target(cfg, params, fingerprint=params_fingerprint(params))


def _prompts(lengths):
    rng = np.random.default_rng(5)
    return [[1] + rng.integers(3, VOCAB, k - 1).tolist() for k in lengths]


def test_greedy_speculative_equals_plain(moe_target):
    prompts = _prompts((30, 13))
    ar = generate_autoregressive(moe_target, prompts, max_new_tokens=16, cache_len=64)
    sp = generate_speculative(moe_target, random_drafter(moe_target, block_size=4), prompts, max_new_tokens=16,
                              cache_len=64, num_speculative_tokens=4)  # fmt: skip
    assert_same_outputs(ar, sp)


def test_engine_equals_plain_decoding(moe_target):
    """Packed decode steps and verification with one-shot and chunked prefill give plain decoding's tokens."""
    from dspark_jax.serving.engine import Request, SamplingParams

    drafter = bigram_drafter(moe_target, block_size=3)
    eng = chunked_engine(moe_target, drafter)
    prompts = _prompts((30, 21, 5))
    reqs = [Request(p, SamplingParams(temperature=0.0, max_new_tokens=10), f"m{i}") for i, p in enumerate(prompts)]
    ar = generate_autoregressive(moe_target, prompts, max_new_tokens=10, cache_len=64)
    want = {r.request_id: (g.token_ids, g.finish_reason) for r, g in zip(reqs, ar.generations)}
    for chunked in (False, True):
        assert drive(eng, reqs, chunked=chunked, slots=3) == want


def test_drafter_for_moe_target_trains_and_decodes_exactly(moe_target):
    from dspark_jax.training.data import batches
    from dspark_jax.training.trainer import Trainer
    from tests.helpers.tiny import tiny_drafter, tiny_train_config

    cfg = tiny_train_config(steps=3, batch_size=4, anchors_per_seq=4, learning_rate=1e-2)
    drafter = tiny_drafter(moe_target, train=cfg)
    tr = Trainer(cfg, moe_target, drafter)
    rng = np.random.default_rng(0)
    data = {"tokens": rng.integers(3, VOCAB, (8, 32)).astype(np.int32), "lengths": np.full(8, 32, np.int32),
            "prompt_lengths": np.full(8, 4, np.int32)}  # fmt: skip
    it = batches(data, cfg.batch_size, seed=0)
    losses = [float(tr.step(next(it), s)[0].loss) for s in range(3)]
    assert all(np.isfinite(losses))
    prompts = _prompts((20, 9))
    ar = generate_autoregressive(moe_target, prompts, max_new_tokens=12, cache_len=48)
    d = tr.drafter()
    sp = generate_speculative(
        moe_target, d, prompts, max_new_tokens=12, cache_len=48, num_speculative_tokens=d.cfg.block_size
    )
    assert_same_outputs(ar, sp)


def test_drafter_for_moe_target_exports_in_the_formats_and_reimports_identically(moe_target, tmp_path):
    """The drafter is dense: DeepSpec's and speculators' formats hold it unchanged, and speculators'
    verifier section names the MoE target's architecture (not the dense Qwen3 one)."""
    import dataclasses

    import jax
    from flax import nnx

    from dspark_jax.config import DrafterConfig
    from dspark_jax.drafters.build import build_drafter
    from dspark_jax.drafters.checkpoint import load_drafter
    from dspark_jax.drafters.format_export import export_to_format

    cfg = DrafterConfig.for_target(moe_target.cfg, block_size=3, num_layers=1, markov_rank=4)
    drafter = build_drafter(cfg, nnx.Rngs(3))
    want = jax.tree.leaves(nnx.to_pure_dict(nnx.state(drafter, nnx.Param)))
    for fmt in ("deepspec", "speculators"):
        out, _ = export_to_format(drafter, moe_target, fmt, tmp_path / fmt)
        conf = json.loads((out / "config.json").read_text())
        if fmt == "speculators":
            assert conf["speculators_config"]["verifier"]["architectures"] == ["Qwen3MoeForCausalLM"]
        else:
            assert conf["num_target_layers"] == moe_target.cfg.num_layers
        again, meta = load_drafter(out, target=moe_target)
        assert meta["extra"]["source_format"] == fmt and again.cfg.target_fingerprint == moe_target.fingerprint
        assert dataclasses.replace(again.cfg, target_fingerprint="") == drafter.cfg
        got = jax.tree.leaves(nnx.to_pure_dict(nnx.state(again, nnx.Param)))
        assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(want, got)), fmt


def test_qwen3_30b_a3b_preset_counts_total_and_active_parameters():
    """The built-in Qwen3-30B-A3B config (what ``--dry-run`` plans): 30.5B parameters, 3.35B active."""
    from dspark_jax.models.presets import target_config

    cfg = target_config("qwen3-30b-a3b")
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.num_sparse_layers) == (128, 8, 48)
    assert count_target_params(cfg) == 30_532_122_624
    assert count_target_params(cfg, active=True) == 3_353_032_704


def test_warm_start_from_moe_target_layers_is_refused(moe_target):
    from dspark_jax.training.warm_start import init_from_target_layers

    with pytest.raises(DSparkInputError, match="mixture-of-experts target"):
        init_from_target_layers(random_drafter(moe_target, block_size=4), moe_target, [0])


def test_experts_split_over_the_model_axis():
    """Each expert's hidden units go over ``model`` (a batch-1 step reads the routed experts' slices on
    every chip); when the axis does not divide that width, the experts themselves do."""
    import jax

    from dspark_jax.models.sharding import AbstractMesh, logical_spec, param_axes

    def spec(shape, model):
        (path, leaf), *_ = jax.tree_util.tree_flatten_with_path({"layers": {"moe_gate": np.empty(shape)}})[0]
        return tuple(logical_spec(param_axes(path, shape), shape, AbstractMesh({"model": model})))

    assert spec((2, 8, 32, 16), 4) == (None, None, None, "model")  # [L, E, H, Im]: hidden units
    assert spec((2, 8, 32, 6), 4) == (None, "model")  # 4 does not divide 6 units: experts
    assert spec((2, 6, 32, 6), 4) == ()  # nor 6 experts: replicated
