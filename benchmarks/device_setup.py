"""What the sections of :mod:`benchmarks.device_check` share: the devices' peak tables, the model
shapes (Qwen3-8B's, a tiny one), the run's sizes (:class:`Plan`), random weights drawn on the
device, the sections' :class:`Context` and the printed tables."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.harness import json_default
from dspark_jax.config import DrafterConfig, TargetConfig
from dspark_jax.drafters.build import build_drafter
from dspark_jax.models.target import Target

# Peak HBM bandwidth [GB/s] and dense bfloat16 [TFLOP/s] by a substring of the lower-cased
# jax device_kind, first match wins (vendors' data sheets; SXM parts unless named).
PEAK_BW_GB_S = (
    ("h200", 4800.0),
    ("h100 pcie", 2000.0),
    ("h100", 3350.0),
    ("a100", 2039.0),
    ("v5 lite", 819.0),
    ("v5e", 819.0),
    ("v5p", 2765.0),
    ("tpu v5", 2765.0),
    ("v6 lite", 1640.0),
    ("v6e", 1640.0),
    ("tpu v4", 1200.0),
)
PEAK_TFLOPS = (
    ("h200", 989.0),
    ("h100 pcie", 756.0),
    ("h100", 989.0),
    ("a100", 312.0),
    ("v5 lite", 197.0),
    ("v5e", 197.0),
    ("v5p", 459.0),
    ("tpu v5", 459.0),
    ("v6 lite", 918.0),
    ("v6e", 918.0),
    ("tpu v4", 275.0),
)


def peak(table: tuple[tuple[str, float], ...], device_kind: str) -> float | None:
    """The first entry of ``table`` whose key is in ``device_kind`` (case-insensitive), else None."""
    kind = device_kind.lower()
    return next((v for k, v in table if k in kind), None)


def qwen3_8b_config() -> TargetConfig:
    """Qwen3-8B's shape (its config.json); no EOS, so random models run every step asked for."""
    return TargetConfig(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        max_position=40960,
        rope_theta=1e6,
        rms_eps=1e-6,
        tie_embeddings=False,
        qk_norm=True,
        bos_id=None,
        eos_ids=(),
        name="qwen3-8b-random",
    )


def tiny_config() -> TargetConfig:
    """A CPU-sized target of the same kind (q/k-norm, untied head)."""
    return dataclasses.replace(
        qwen3_8b_config(),
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position=1024,
        name="tiny-random",
    )


@dataclasses.dataclass(frozen=True)
class Plan:
    """Sizes of one run (:func:`plan`)."""

    caches: tuple[int, ...]  # step: KV-cache lengths
    lives: tuple[int, ...]  # step: live lengths shared by every cache (plus 3/4 of each cache)
    reps: int  # step: timed steps per point
    block_size: int  # the drafter's block size (engine fixed:block_size, speculative decoding)
    drafter_layers: int
    ar_new: int  # roofline: generate_autoregressive's new tokens
    rows: tuple[int, ...]  # engine: active rows measured
    row_buckets: tuple[int, ...]  # engine: compiled row counts (the last one holds max(rows))
    engine_cache: int
    engine_prompt: int
    engine_steps: int
    train_shape: tuple[int, int, int]  # (batch, seq_len, anchors per sequence)
    train_steps: int
    exact_shape: tuple[int, int, int]  # (prompts, prompt length, new tokens)
    stories: bool  # exactness on stories260K too, when $DSPARK_MODELS has it


def plan(tiny: bool) -> Plan:
    if tiny:
        return Plan(
            caches=(128, 256),
            lives=(16, 64),
            reps=3,
            block_size=4,
            drafter_layers=1,
            ar_new=16,
            rows=(1, 4),
            row_buckets=(4,),
            engine_cache=256,
            engine_prompt=16,
            engine_steps=3,
            train_shape=(2, 32, 4),
            train_steps=2,
            exact_shape=(2, 12, 24),
            stories=False,
        )
    return Plan(
        caches=(1024, 4096, 16384),
        lives=(128, 512),
        reps=10,
        block_size=8,
        drafter_layers=2,
        ar_new=64,
        rows=(1, 8, 64),
        row_buckets=(1, 8, 64),
        engine_cache=2048,
        engine_prompt=64,
        engine_steps=8,
        train_shape=(4, 1024, 16),
        train_steps=5,
        exact_shape=(4, 64, 64),
        stories=True,
    )


def device_params(cfg: TargetConfig, dtype: Any, seed: int = 0, scale: float = 0.05) -> dict[str, Any]:
    """Random parameters drawn on the default device in ``dtype`` by one compiled program: the
    layout and scales of :func:`~dspark_jax.models.target.random_params` (norm weights ``1 + n``,
    the embedding ``10 n``)."""
    from dspark_jax.models.weights import target_param_shapes

    shapes = target_param_shapes(cfg)
    flat = [(k, s) for k, s in shapes.items() if k != "layers"] + list(shapes["layers"].items())

    def draw(key: jax.Array) -> list[jax.Array]:
        out = []
        for (name, shape), k in zip(flat, jax.random.split(key, len(flat))):
            x = jax.random.normal(k, shape, dtype) * jnp.asarray(scale, dtype)
            out.append(
                x + jnp.asarray(1, dtype) if "norm" in name else x * jnp.asarray(10 if name == "embed" else 1, dtype)
            )
        return out

    arrays = dict(zip([k for k, _ in flat], jax.jit(draw)(jax.random.PRNGKey(seed))))
    params: dict[str, Any] = {k: arrays[k] for k in shapes if k != "layers"}
    params["layers"] = {k: arrays[k] for k in shapes["layers"]}
    return params


def random_drafter(cfg: DrafterConfig, dtype: Any, seed: int = 0) -> Any:
    """:func:`~dspark_jax.drafters.build.build_drafter` initialised by one compiled program."""
    return nnx.jit(lambda: build_drafter(cfg, nnx.Rngs(seed), dtype=dtype))()


@dataclasses.dataclass
class Context:
    """What the sections share: arguments, models, sizes and the report."""

    args: argparse.Namespace
    plan: Plan
    dtype: Any
    cfg: TargetConfig
    params: dict[str, Any]
    target: Target
    drafter: Any
    out: Path | None
    report: dict[str, Any]
    compile_s: dict[str, float]
    started: float  # time.perf_counter() when the run started
    step_rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    current: str = ""  # the section running

    def partial(self, data: dict[str, Any]) -> None:
        """Records and writes the running section's results so far (a run cut short keeps them)."""
        self.report["sections"][self.current] = {"partial": True, **data}
        self.write()

    def write(self) -> None:
        if self.compile_s and "compile" in self.args.sections:
            self.report["sections"].pop("compile", None)  # kept last
            self.report["sections"]["compile"] = {
                "seconds": dict(self.compile_s),
                "total_s": sum(self.compile_s.values()),
            }
        self.report["meta"]["elapsed_s"] = time.perf_counter() - self.started
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
            tmp = self.out / "device_check.json.tmp"
            tmp.write_text(json.dumps(self.report, indent=2, default=json_default))
            tmp.replace(self.out / "device_check.json")


def table(title: str, headers: list[str], rows: list[list[Any]]) -> None:
    """Prints a plain table: numbers with 4 significant digits, None as '-'."""
    fmt = lambda v: "-" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))
    cells = [headers] + [[fmt(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    print(f"\n== {title}")
    for i, r in enumerate(cells):
        print("  " + "  ".join(c.rjust(w) for c, w in zip(r, widths)))
        if i == 0:
            print("  " + "  ".join("-" * w for w in widths))
