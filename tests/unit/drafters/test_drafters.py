"""The drafter interface (:mod:`dspark_jax.drafters.base`) and the drafters package's structure.

* a format-2 export committed under ``tests/data`` (written by ``tests/data/make_tiny_export.py``,
  Markov-head weights at the top level) loads, with its config and calibration, and drafts
  exactly what it drafted when it was made (pinned greedy and sampled drafts);
* both drafter kinds satisfy the ``runtime_checkable`` protocols they claim: every kind is a
  :class:`Drafter`, only DSpark / DFlash are :class:`BlockDrafter` (eagle3 has no block pass, no
  Markov or confidence methods);
* the packed context write (the serving engine's layout) equals ``extend_cache``, for both kinds;
* ``remat`` is an argument of ``train_blocks``: same values, rematerialised backward pass;
* no drafters module imports inside a function, the drafters modules import each other without
  a cycle, and only from lower layers (config, errors, models).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.config import DrafterConfig, TargetConfig
from dspark_jax.drafters.base import BlockDrafter, Drafter
from dspark_jax.drafters.build import BLOCK_VARIANTS, DRAFTER_TYPES, build_drafter
from dspark_jax.drafters.checkpoint import FORMAT, export_drafter, load_drafter
from dspark_jax.drafters.dspark import DSparkDrafter
from dspark_jax.drafters.eagle import EagleDrafter, eagle_taps
from dspark_jax.models.sampling import sampling_arrays
from dspark_jax.models.target import Target, random_params

DATA = Path(__file__).resolve().parents[2] / "data"
_spec = importlib.util.spec_from_file_location("make_tiny_export", DATA / "make_tiny_export.py")
assert _spec is not None and _spec.loader is not None
_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_script)
TINY_EXPORT = _script.OUT
TINY_TARGET = TargetConfig(**_script.TINY_TARGET)
CTX = [[1, 5, 9, 2, 7, 11], [3, 3, 14, 6, 0, 8]]

# Drafts of the tiny export, computed when it was written (format 2, before the Markov heads
# became modules) with the context CTX and target random_params(TINY_TARGET, seed=3, scale=0.5).
PIN_GREEDY_TOKENS = [[6, 3, 3], [6, 3, 14]]
PIN_GREEDY_CONF = [[0.685203, 0.488294, 0.482481], [0.556489, 0.309913, 0.338343]]
PIN_GREEDY_ZLOG = [[0.622230, -0.058541, -0.112170], [0.181541, -1.000658, -1.073102]]
PIN_SAMPLED_TOKENS = [[6, 11, 11], [6, 11, 14]]
PIN_SAMPLED_PROBS_ROW0 = [
    [0.016486, 0.004177, 0.030364, 0.005255, 0.012525, 0.237902, 0.359348, 0.032901]
    + [0.010831, 0.179028, 0.001865, 0.036706, 0.048677, 0.013854, 0.003249, 0.006832],
    [0.009142, 0.116828, 0.014835, 0.345398, 0.021305, 0.002312, 0.015289, 0.071972]
    + [0.074345, 0.006468, 0.05082, 0.11257, 0.015728, 0.01599, 0.115277, 0.011722],
    [0.00807, 0.161966, 0.017614, 0.281529, 0.02534, 0.001459, 0.014217, 0.059689]
    + [0.074055, 0.008007, 0.054537, 0.091822, 0.013651, 0.018176, 0.154775, 0.015094],
]


@pytest.fixture(scope="module")
def tiny_target() -> Target:
    return Target(TINY_TARGET, random_params(TINY_TARGET, seed=3, scale=0.5))


def _context(target: Target, drafter: Drafter, cache_len: int = 32):
    ctx = jnp.asarray(CTX, jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(ctx.shape[1], dtype=jnp.int32), ctx.shape)
    out = target(ctx, pos, target.init_cache(ctx.shape[0], cache_len), taps=drafter.cfg.taps)
    return ctx, pos, out.features


def test_format2_export_loads_and_drafts_what_it_drafted(tiny_target):
    d, meta = load_drafter(TINY_EXPORT)
    assert isinstance(d, DSparkDrafter) and isinstance(d, BlockDrafter)
    assert meta["format"] == "dspark_jax.drafter/2" and meta["extra"]["made_by"].endswith("make_tiny_export.py")
    c = d.cfg
    assert (c.variant, c.markov_head, c.block_size, c.num_layers, c.markov_rank, c.taps) == (
        "dspark",
        "gated",
        3,
        1,
        4,
        (0, 2),
    )
    assert (c.vocab_size, c.hidden_size, c.target_num_layers, c.target_name) == (16, 8, 3, "tiny")
    assert d.calibration == (0.8, 1.25, 1.6) and d.calibration_greedy is None and d.draft_vocab is None
    assert d.markov_head is not None and d.markov_head.gate_w.shape == (12, 4)
    ctx, pos, feats = _context(tiny_target, d)
    cache = d.extend_cache(d.init_cache(2, 32), feats, pos)
    anchors, apos = ctx[:, -1], jnp.asarray([5, 5], jnp.int32)
    keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(2, dtype=jnp.uint32))
    greedy = d.draft(tiny_target, anchors, apos, cache, keys, sampling_arrays(2, 0.0))
    assert np.asarray(greedy.tokens).tolist() == PIN_GREEDY_TOKENS
    np.testing.assert_allclose(greedy.confidence, PIN_GREEDY_CONF, atol=2e-6)
    np.testing.assert_allclose(greedy.confidence_logit, PIN_GREEDY_ZLOG, atol=2e-6)
    sampled = d.draft(tiny_target, anchors, apos, cache, keys, sampling_arrays(2, 1.0))
    assert np.asarray(sampled.tokens).tolist() == PIN_SAMPLED_TOKENS
    np.testing.assert_allclose(sampled.probs[0], PIN_SAMPLED_PROBS_ROW0, atol=2e-6)


def test_reexport_writes_the_current_format(tmp_path):
    d, _ = load_drafter(TINY_EXPORT)
    path = export_drafter(d, tmp_path / "again")
    loaded, meta = load_drafter(path)
    assert meta["format"] == FORMAT and loaded.calibration == d.calibration
    tree = nnx.to_pure_dict(nnx.state(loaded, nnx.Param))
    assert set(tree["markov_head"]) == {"w1", "w2", "gate_w", "gate_b"} and "markov_w1" not in tree
    for a, b in zip(jax.tree.leaves(nnx.state(d, nnx.Param)), jax.tree.leaves(nnx.state(loaded, nnx.Param))):
        np.testing.assert_array_equal(a, b)


def test_new_drafters_get_the_formats_architecture_and_legacy_stays_loadable(tiny_target):
    """for_target builds the checkpoint formats' architecture (q/k-norm weights, no learned mask
    vector, mask slots = the target's embedding row, W1 over the target vocabulary); ``arch="legacy"``
    the first one, which the committed format-2 export holds."""
    from dspark_jax.config import LEGACY_ARCH
    from dspark_jax.errors import DSparkInputError

    new = DrafterConfig.for_target(TINY_TARGET, block_size=3, num_layers=1, markov_rank=4, draft_vocab_size=6)
    assert new.qk_norm and new.mask_token_id == TINY_TARGET.vocab_size - 1
    assert new.markov_w1_size == TINY_TARGET.vocab_size
    d = build_drafter(new, nnx.Rngs(0))
    tree = nnx.to_pure_dict(nnx.state(d, nnx.Param))
    assert "mask_embed" not in tree and tree["layers"]["q_norm"].shape == (1, TINY_TARGET.head_dim)
    x = d.block_inputs(tiny_target, jnp.asarray([5, 7]))
    mask_row = tiny_target.embed_tokens(jnp.asarray(TINY_TARGET.vocab_size - 1))
    np.testing.assert_array_equal(x[:, 1:], jnp.broadcast_to(mask_row, (2, 2, mask_row.shape[-1])))
    old = DrafterConfig.for_target(TINY_TARGET, arch="legacy", block_size=3, num_layers=1, markov_rank=4)
    assert {k: getattr(old, k) for k in LEGACY_ARCH} == LEGACY_ARCH
    loaded, _ = load_drafter(TINY_EXPORT)
    assert {k: getattr(loaded.cfg, k) for k in LEGACY_ARCH} == LEGACY_ARCH
    with pytest.raises(DSparkInputError, match="drafter_arch"):
        DrafterConfig.for_target(TINY_TARGET, arch="v2")


def _config(variant: str) -> DrafterConfig:
    over = dict(variant=variant, block_size=3, num_layers=1)
    if variant == "eagle3":
        over.update(markov_rank=0, taps=eagle_taps(TINY_TARGET))
    else:
        over.update(markov_rank=4, taps=(0, 2))
    return DrafterConfig.for_target(TINY_TARGET, **over)


def _random_drafter(variant: str, seed: int = 0) -> Drafter:
    """Every parameter random (none left at a zero init), so caches and drafts are not trivial."""
    d = build_drafter(_config(variant), nnx.Rngs(seed))
    state = nnx.state(d, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(leaves))
    leaves = [0.5 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
    nnx.update(d, jax.tree.unflatten(treedef, leaves))
    return d


@pytest.mark.parametrize("variant", sorted(DRAFTER_TYPES))
def test_drafter_kinds_satisfy_their_protocols(variant):
    d = build_drafter(_config(variant), nnx.Rngs(0))
    assert isinstance(d, Drafter)
    # BLOCK_VARIANTS (what the serving dry run reads) says which configs build a BlockDrafter
    assert isinstance(d, BlockDrafter) == (variant in BLOCK_VARIANTS) == (variant != "eagle3")
    assert isinstance(d, EagleDrafter if variant == "eagle3" else DSparkDrafter)
    if variant == "eagle3":  # no fake block / Markov / confidence methods
        for name in ("draft_block", "markov_step", "markov_init", "teacher_forced_heads", "confidence_logit"):
            assert not hasattr(d, name), name
        with pytest.raises(ValueError, match="no confidence head"):
            d.set_calibration([1.0, 1.0, 1.0])
        with pytest.raises(ValueError, match="full vocabulary"):
            d.set_draft_vocab(range(4))
    else:
        assert (d.markov_head is None) == (variant == "dflash")


@pytest.mark.parametrize("variant", ["dspark", "eagle3"])
def test_packed_context_write_equals_extend_cache(tiny_target, variant):
    d = _random_drafter(variant)
    ctx, pos, feats = _context(tiny_target, d)
    b, t = ctx.shape
    pos = jnp.where(jnp.asarray([[1] * t, [1] * (t - 2) + [0, 0]], bool), pos, -1)  # padding dropped
    want = d.extend_cache(d.init_cache(b, 16), feats, pos, target=tiny_target, tokens=ctx)
    rows = jnp.repeat(jnp.arange(b, dtype=jnp.int32), t)
    got = d.write_context(
        d.init_cache(b, 16), feats.reshape(b * t, -1), rows, pos.reshape(-1), target=tiny_target, tokens=ctx.reshape(-1)
    )
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert float(jnp.max(jnp.abs(w))) > 0
        np.testing.assert_allclose(g, w, atol=1e-5)


@pytest.mark.parametrize("variant", ["dspark", "eagle3"])
def test_draft_shapes_and_law_fields(tiny_target, variant):
    d = _random_drafter(variant)
    ctx, pos, feats = _context(tiny_target, d)
    cache = d.extend_cache(d.init_cache(2, 32), feats, pos, target=tiny_target, tokens=ctx)
    keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(2, dtype=jnp.uint32))
    dr = d.draft(tiny_target, ctx[:, -1], jnp.asarray([5, 5], jnp.int32), cache, keys, sampling_arrays(2, 1.0))
    assert dr.tokens.shape == (2, 3) and dr.probs.shape == (2, 3, 16)
    np.testing.assert_allclose(jnp.sum(dr.probs, -1), 1.0, atol=1e-5)
    if variant == "eagle3":
        assert np.all(np.asarray(dr.confidence) == 1) and np.all(np.isinf(dr.confidence_logit))
    else:
        assert np.all((np.asarray(dr.confidence) > 0) & (np.asarray(dr.confidence) < 1))


def test_remat_is_an_argument_of_train_blocks(tiny_target):
    d = _random_drafter("dspark")
    ctx, pos, feats = _context(tiny_target, d)
    anchors = jnp.asarray([[1, 3], [0, 2]], jnp.int32)

    def loss(state, remat):
        m = nnx.merge(nnx.graphdef(d), state)
        return jnp.sum(m.train_blocks(tiny_target, feats, ctx, anchors, remat=remat).logits ** 2)

    state = nnx.state(d)
    g0, g1 = (jax.grad(loss)(state, r) for r in (False, True))
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    jaxpr = lambda r: str(jax.make_jaxpr(jax.grad(lambda s: loss(s, r)))(state))
    assert "remat" in jaxpr(True) and "remat" not in jaxpr(False)
    assert not hasattr(d, "remat")


# ----------------------------------------------------------------------------- package structure

DRAFTERS = Path(__file__).resolve().parents[3] / "dspark_jax" / "drafters"
LOWER = ("dspark_jax.config", "dspark_jax.errors", "dspark_jax.models")


def _package_imports(path: Path) -> list[tuple[str, bool]]:
    """``(module, inside_a_function)`` of every ``dspark_jax`` import of a module."""
    out = []

    def visit(node, in_fn):
        for child in ast.iter_child_nodes(node):
            fn = in_fn or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.ImportFrom) and child.module and child.module.startswith("dspark_jax"):
                out.append((child.module, in_fn))
            elif isinstance(child, ast.Import):
                out.extend((a.name, in_fn) for a in child.names if a.name.startswith("dspark_jax"))
            visit(child, fn)

    visit(ast.parse(path.read_text()), False)
    return out


def test_drafters_import_no_higher_layer_no_cycle_and_not_inside_functions():
    modules = {f"dspark_jax.drafters.{p.stem}": p for p in DRAFTERS.glob("*.py") if p.stem != "__init__"}
    graph = {}
    for name, path in modules.items():
        imports = _package_imports(path)
        assert not [m for m, inside in imports if inside], f"{name} imports inside a function"
        for m, _ in imports:
            assert m.startswith(LOWER) or m in modules, f"{name} imports {m} (a higher layer)"
        graph[name] = {m for m, _ in imports if m in modules}
    done: set[str] = set()

    def walk(node, stack):
        assert node not in stack, "import cycle: " + " -> ".join([*stack, node])
        if node not in done:
            for nxt in graph[node]:
                walk(nxt, [*stack, node])
            done.add(node)

    for name in graph:
        walk(name, [])
