"""The attention backends (docs/design.md#attention-backends) against the xla path, on CPU.

Issue 24: one attention entry point, :func:`~dspark_jax.models.attention.attend`, with backends
chosen by platform. On CPU ``auto`` is exactly :func:`~dspark_jax.models.layers.cached_attention`
(the same jaxpr, so the engine's programs do not change); the cuDNN path's arguments (mask and
key/value lengths) run through ``jax.nn.dot_product_attention``'s XLA implementation; the Pallas
TPU path's paged view and per-query metadata run through JAX's ``ref_ragged_paged_attention``
(the kernel itself does not run in TPU interpret mode on CPU in jax 0.10.2); float32 and unfit
shapes fall back to xla. Small random GQA shapes with ragged lengths, blind queries and a cache
with more rows than queries.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.config import TargetConfig
from dspark_jax.errors import DSparkInputError
from dspark_jax.models import attention as A
from dspark_jax.models.layers import cached_attention

B, T, NH, NKV, HD, S, LAYERS = 3, 4, 4, 2, 16, 48, 2


@pytest.fixture(scope="module")
def case():
    """``(q [B, T, NH, HD], k, v [LAYERS, B + 1, S, NKV, HD], q_pos [B, T], want)``: ragged rows, a
    query that sees one slot, a row with a blind (``-1``) query, one at the last slot; ``want`` is
    the xla path's output for layer 1."""
    rng = np.random.default_rng(0)
    k, v = (jnp.asarray(rng.standard_normal((LAYERS, B + 1, S, NKV, HD)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((B, T, NH, HD)), jnp.float32)
    q_pos = jnp.asarray([[0, 1, 2, 3], [20, 21, -1, 23], [44, 45, 46, 47]], jnp.int32)
    return q, k, v, q_pos, jax.jit(cached_attention)(q, k, v, 1, q_pos)


def _close(got, want):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_auto_is_xla_on_cpu_with_the_same_program(case):
    q, k, v, q_pos, _ = case
    assert A.current_platform() == "cpu"
    for dtype in (jnp.float32, jnp.bfloat16):
        assert A.select_backend("auto", q.astype(dtype), k) == ("xla", None)
    want = jax.make_jaxpr(lambda *a: cached_attention(*a))(q, k, v, 1, q_pos)
    got = jax.make_jaxpr(lambda *a: A.attend(*a, backend="auto"))(q, k, v, 1, q_pos)
    assert str(got) == str(want)


def test_auto_by_platform_and_the_dtype_rule(case):
    q, k, *_ = case
    bf16 = q.astype(jnp.bfloat16)
    assert A.select_backend("auto", bf16, k, platform="gpu") == ("cudnn", None)
    name, reason = A.select_backend("auto", q, k, platform="gpu")  # float32: cuDNN takes fp16/bf16 only
    assert name == "xla" and reason is not None and "float32" in reason
    assert A.select_backend("auto", q, k, platform="rocm") == ("xla", None)
    # On a TPU auto is xla (the compiler costs the kernel path higher); pallas_tpu is asked by name.
    fit_q = jax.ShapeDtypeStruct((1, 1, 16, 128), jnp.bfloat16)
    fit_k = jax.ShapeDtypeStruct((2, 1, 256, 8, 128), jnp.bfloat16)
    assert A.select_backend("auto", fit_q, fit_k, platform="tpu") == ("xla", None)
    assert A.select_backend("pallas_tpu", fit_q, fit_k, platform="tpu") == ("pallas_tpu", None)
    with pytest.raises(DSparkInputError, match="head_dim 16 is not a multiple of 128"):  # the TPU lane width
        A.select_backend("pallas_tpu", q, k, platform="tpu")
    # By name, a backend that cannot serve the program is refused with the reason, never replaced.
    odd_heads = jax.ShapeDtypeStruct((2, 1, 256, 3, 128), jnp.float32)  # 6 combined f32 heads: not tiled
    odd_q = jax.ShapeDtypeStruct((1, 1, 6, 128), jnp.float32)
    with pytest.raises(DSparkInputError, match="'pallas_tpu' cannot run this program: the kernel does not take"):
        A.select_backend("pallas_tpu", odd_q, odd_heads, "tpu")
    with pytest.raises(DSparkInputError, match="cache length 100"):
        A.select_backend("pallas_tpu", fit_q, jax.ShapeDtypeStruct((2, 1, 100, 8, 128), jnp.bfloat16), "tpu")
    with pytest.raises(DSparkInputError, match="float32 queries"):
        A.select_backend("cudnn", q, k, platform="gpu")
    with pytest.raises(DSparkInputError, match="soft-cap"):
        A.select_backend("cudnn", bf16, k, platform="gpu", softcap=50.0)
    assert A.select_backend("pallas_tpu", fit_q, fit_k, platform="tpu", softcap=50.0) == ("pallas_tpu", None)
    with pytest.raises(ValueError, match="not one of"):
        A.select_backend("flash", q, k)
    with pytest.raises(ValueError, match="attention_backend"):
        TargetConfig(10, 8, 16, 1, 2, 1, 4, 32, attention_backend="flash")


def test_cudnn_arguments_through_xla_match_the_xla_path(case):
    q, k, v, q_pos, want = case
    for impl in ("xla", None):
        got = jax.jit(lambda *a, impl=impl: A.cudnn_attention(*a, implementation=impl))(q, k, v, 1, q_pos)
        _close(got, want)
    got = jax.jit(lambda *a: A.cudnn_attention(*a, implementation="xla"))(q, k, v, 0, jnp.full_like(q_pos, -1))
    assert not np.any(np.asarray(got))  # blind queries: exactly 0, as cached_attention
    a = A.cudnn_arguments(q, k, v, 1, q_pos)
    assert a.mask.shape == (B, 1, T, S) and a.kv_lens.tolist() == [4, 24, 48]


def _reference_kernel(q, kv_pages, *metadata, sm_scale):
    """JAX's ``ref_ragged_paged_attention`` compiled once for the given (concrete) metadata: it
    loops over the sequences in Python, so the metadata are closed over as constants."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

    meta: list[Any] = [np.asarray(m) for m in metadata]  # concrete: the reference slices by them
    return jax.jit(lambda qq, pages: ref_ragged_paged_attention(qq, pages, *meta, sm_scale=sm_scale))(q, kv_pages)


def test_pallas_paged_view_through_the_reference_matches_the_xla_path(case):
    q, k, v, q_pos, want = case
    # The last two queries of each row (6 kernel sequences: the reference's compile time grows with
    # them): a blind query, the last slot; pages of 16 slots.
    got = A.pallas_tpu_attention(q[:, 2:], k, v, 1, q_pos[:, 2:], kernel=_reference_kernel)
    _close(got, want.reshape(B, T, -1)[:, 2:])
    a = A.ragged_paged_arguments(q, k, v, 1, q_pos, 16)
    assert A.page_size_for(S) == 16 and A.page_size_for(100) is None
    assert a.kv_pages.shape == (B * S // 16, 16, 2 * NKV, HD)
    assert a.page_indices.shape == (B * T, S // 16) and int(a.num_seqs[0]) == B * T
    assert a.kv_lens.tolist() == [1, 2, 3, 4, 21, 22, 1, 24, 45, 46, 47, 48]
    np.testing.assert_array_equal(np.asarray(a.kv_pages[5, 3, 2]), np.asarray(k[1, 1, 35, 1]))  # K of head 1
    np.testing.assert_array_equal(np.asarray(a.kv_pages[5, 3, 3]), np.asarray(v[1, 1, 35, 1]))  # V of head 1
    np.testing.assert_array_equal(np.asarray(a.page_indices[5]), [3, 4, 5])  # query (1, 1): row 1's pages
    assert a.cu_q_lens.tolist() == list(range(B * T + 1))
    with pytest.raises(ValueError, match="page size"):
        A.ragged_paged_arguments(q, k, v, 1, q_pos, 32)


@pytest.mark.parametrize("backend", ["cudnn", "pallas_tpu"])
def test_named_backend_off_platform_is_refused_by_name(case, backend):
    """A kernel backend asked for by name where it cannot run (here: on the CPU) is a one-line
    error naming the backend and what it needs, not a quiet switch to xla."""
    q, k, v, q_pos, _ = case
    need = {"cudnn": "needs a CUDA GPU", "pallas_tpu": "needs a TPU"}[backend]
    with pytest.raises(DSparkInputError, match=f"attention backend '{backend}' cannot run this program: .*{need}"):
        jax.jit(lambda *a: A.attend(*a, backend=backend))(q, k, v, 1, q_pos)


def test_auto_logs_why_it_takes_xla_once(case, caplog, monkeypatch):
    q, k, v, q_pos, want = case
    monkeypatch.setattr(A, "current_platform", lambda: "gpu")
    monkeypatch.setattr(A, "_noted", set())
    with caplog.at_level(logging.INFO, logger=A.__name__):
        got = jax.jit(lambda *a: A.attend(*a, backend="auto"))(q, k, v, 1, q_pos)  # float32: not cuDNN's
        jax.eval_shape(lambda *a: A.attend(*a, backend="auto"), q, k, v, 0, q_pos)  # a second trace: no second line
    assert np.array_equal(np.asarray(got), np.asarray(want))
    notes = [r.getMessage() for r in caplog.records if "runs as xla" in r.getMessage()]
    assert len(notes) == 1 and "float32 queries" in notes[0]


def test_the_override_reaches_the_target_config(stories260k_dir):
    from dspark_jax.api import load_target
    from dspark_jax.commands.eval import build_parser as eval_parser
    from dspark_jax.commands.generate import build_parser as generate_parser
    from dspark_jax.commands.serve import build_parser as serve_parser

    need = ["--target", "t", "--drafter", "d"]
    assert generate_parser().parse_args([*need, "--prompt", "p"]).attention_backend is None
    args = eval_parser().parse_args([*need, "--prompts", "x", "--out", "o", "--attention-backend", "cudnn"])
    assert args.attention_backend == "cudnn"
    assert serve_parser().parse_args([*need, "--attention-backend", "pallas_tpu"]).attention_backend == "pallas_tpu"
    assert TargetConfig(10, 8, 16, 1, 2, 1, 4, 32).attention_backend == "auto"
    assert load_target("stories260k", attention_backend="xla")[0].cfg.attention_backend == "xla"


def test_pallas_heads_over_the_mesh_and_block_sizes_by_device_kind():
    """The kernel's ``shard_map`` split follows ``cache_sharding`` (KV heads over ``model``, over
    ``model_kv`` of its split when fewer, else whole), and its blocks come from the device kind
    given, cut to half the explicit VMEM limit: a 4096-slot row of Qwen3-8B's 8 KV heads in one
    block (the tuned whole-row choice) needs 32 MiB of double-buffered pages alone."""
    from jax.sharding import AbstractMesh

    from dspark_jax.models import pallas_tpu as T

    m8 = AbstractMesh((1, 1, 8), ("data", "fsdp", "model"))
    assert T.head_split(None, 32, 8)[1:] == (None, None, 32, 8)
    assert T.head_split(m8, 32, 8)[1:] == ("model", "model", 4, 1)
    split = T.head_split(m8, 32, 4)
    assert dict(split.mesh.shape) == {"data": 1, "fsdp": 1, "model_kv": 4, "model_rep": 2}
    assert split[1:] == (("model_kv", "model_rep"), "model_kv", 4, 1)
    assert T.head_split(m8, 4, 2)[1:] == ("model_kv", "model_kv", 2, 1)  # 4 query heads do not cover 8 chips
    assert T.head_split(m8, 24, 3)[1:] == (None, None, 24, 3)  # 3 KV heads: whole on every chip
    kinds = {"TPU v4": 4, "TPU v5 lite": 5, "TPU v5": 5, "TPU v6 lite": 6, "TPU7x": 7, "cpu": None}
    assert {k: T.tpu_generation(k) for k in kinds} == kinds
    for kind in ("TPU v5 lite", "TPU v6 lite", "TPU v4"):
        bkv, bq, limit = T.block_sizes(kind, jnp.bfloat16, 32, 8, 128, 128, 1, 32)
        assert limit == (16 if kind == "TPU v4" else 32) << 20 and bq == 1
        assert 2 * bkv * 128 * 16 * 128 * 2 <= limit // 2  # the KV double buffer (16 combined heads, bf16)
        assert 1 <= bkv < 32
