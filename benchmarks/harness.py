"""What the benchmarks share around their measurements: timing cases alternately and taking
medians, pricing ratios, formatting cells and markdown tables, describing the machine, recording
the command line and writing the result JSON, and loading another checkout's package beside this
one for A/B timings.

Nothing here imports JAX at module level: ``benchmarks.device_check`` and ``benchmarks.engine_hlo``
set ``XLA_FLAGS`` before JAX loads, after importing this module.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

# ----------------------------------------------------------------------------- timing


def alternate(cases: Mapping[str, Callable[[], float | None]], reps: int, warmup: int = 1) -> dict[str, float]:
    """Median seconds of each case, the cases run in alternating order.

    Every round runs every case once, forwards on even rounds and backwards on odd ones, so that
    a change of machine load (a shared machine) hits all cases alike; the first ``warmup`` rounds
    (caches, allocator, any compilation left) are not counted.

    Args:
      cases: ``{label: fn}``; ``fn()`` returns its own seconds (when only part of it is to be
        timed), or None to be timed here as a whole (wall clock, :func:`time.perf_counter`).
      reps: counted rounds (>= 1).
      warmup: uncounted rounds first.

    Returns:
      ``{label: median seconds}`` in the order of ``cases``.

    Raises:
      ValueError: ``reps < 1``.
    """
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    times: dict[str, list[float]] = {k: [] for k in cases}
    labels = list(cases)
    for i in range(warmup + reps):
        for label in labels if i % 2 == 0 else labels[::-1]:
            t0 = time.perf_counter()
            secs = cases[label]()
            if i >= warmup:
                times[label].append(secs if secs is not None else time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def median_seconds(fn: Callable[..., Any], *args: Any, reps: int = 15) -> float:
    """Median wall seconds of ``jax.block_until_ready(fn(*args))`` over ``reps`` calls, after one
    uncounted call (compilation and warm-up)."""
    import jax

    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


# ----------------------------------------------------------------------------- reporting


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or None when either is missing or ``b`` is zero."""
    return None if a is None or not b else a / b


def cell(x: Any, spec: str = ".3f", missing: str = "-") -> str:
    """A table cell: a number formatted with ``spec``, None as ``missing``, anything else as text."""
    if x is None:
        return missing
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return format(x, spec)
    return str(x)


def markdown_table(rows: Sequence[Mapping[str, Any]], spec: str = ".3f") -> str:
    """A markdown table of ``rows`` (the first row's keys are the columns; floats formatted with
    ``spec``, integers and text as they are, None as ``-``)."""
    keys = list(rows[0])
    fmt = lambda v: cell(v, spec if isinstance(v, float) else "")
    lines = ["| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys)]
    return "\n".join(lines + ["| " + " | ".join(fmt(r.get(k)) for k in keys) + " |" for r in rows])


def split_ahead(policy: str) -> tuple[str, bool]:
    """``"fixed:8+ahead"`` -> ``("fixed:8", True)``: a benchmark arm's engine policy and whether its
    speculative steps are planned ahead (the server's ``--plan-ahead``).

    Raises:
      DSparkInputError: a suffix other than ``+ahead``.
    """
    from dspark_jax.errors import DSparkInputError

    name, plus, suffix = policy.partition("+")
    if plus and suffix != "ahead":
        raise DSparkInputError(f"policy {policy!r}: the only suffix is '+ahead'")
    return name, bool(plus)


def device_description() -> str:
    """``platform:device kind xN (C host cores)`` of JAX's first device (imports JAX)."""
    import jax

    d = jax.devices()[0]
    return f"{d.platform}:{getattr(d, 'device_kind', '')} x{jax.device_count()} ({os.cpu_count()} host cores)"


def command_line(module: str, argv: Sequence[str] | None = None) -> str:
    """The command that reruns benchmark ``module`` (``"speed_table"``) with ``argv`` (default:
    this process's arguments), as recorded in the result files: ``python -m benchmarks.<module> ...``."""
    args = list(sys.argv[1:] if argv is None else argv)
    return " ".join(["python", "-m", f"benchmarks.{module}", *map(shlex.quote, args)])


def json_default(x: Any) -> Any:
    """``json.dumps(default=...)`` for NumPy scalars and arrays and paths.

    Raises:
      TypeError: anything else that JSON cannot hold.
    """
    if hasattr(x, "tolist") and callable(x.tolist):  # NumPy scalars and arrays
        return x.tolist()
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON: {type(x)}")


def write_json(path: str | Path, obj: Any) -> Path:
    """Writes ``obj`` as indented JSON (a trailing newline; NumPy values and paths converted by
    :func:`json_default`) to ``path``, creating its folder; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, default=json_default) + "\n")
    return path


# ----------------------------------------------------------------------------- another checkout


def _in_package(name: str) -> bool:
    return name == "dspark_jax" or name.startswith("dspark_jax.")


def load_checkout(root: str | Path, submodules: Sequence[str]) -> dict[str, ModuleType]:
    """Imports the ``dspark_jax`` package of checkout ``root`` beside this process's.

    The other package's top module is loaded from its file, and its absolute imports
    (``from dspark_jax.x import y``) resolve through that module's ``__path__``, i.e. inside the
    same checkout, without touching ``sys.path``. This process's ``dspark_jax*`` modules are set
    aside meanwhile and restored afterwards; the other's modules keep their own globals. (Loading
    it under another name instead would run only its top module on this checkout's code.) Imports
    made lazily inside functions at call time resolve to this process's package.

    Args:
      root: a checkout (a folder holding ``dspark_jax/__init__.py``), e.g. from ``git archive``.
      submodules: names under the package (``"api"``, ``"serving.engine"``).

    Returns:
      ``{submodule: module}`` of ``root``'s package.

    Raises:
      FileNotFoundError: ``root`` has no ``dspark_jax`` package.
    """
    init = Path(root).resolve() / "dspark_jax" / "__init__.py"
    if not init.is_file():
        raise FileNotFoundError(f"{root} has no dspark_jax package")
    mine = {k: v for k, v in sys.modules.items() if _in_package(k)}
    for k in mine:
        del sys.modules[k]
    try:
        spec = importlib.util.spec_from_file_location("dspark_jax", init, submodule_search_locations=[str(init.parent)])
        assert spec is not None and spec.loader is not None
        pkg = importlib.util.module_from_spec(spec)
        sys.modules["dspark_jax"] = pkg
        spec.loader.exec_module(pkg)
        return {m: importlib.import_module(f"dspark_jax.{m}") for m in submodules}
    finally:
        for k in [k for k in sys.modules if _in_package(k)]:
            del sys.modules[k]
        sys.modules.update(mine)


def drafter_for(mods: Mapping[str, ModuleType], target_cfg: Any, block_size: int, **fields: Any) -> Any:
    """A random-weight DSpark drafter for ``target_cfg`` built by a checkout's modules
    (:func:`load_checkout`; keys ``"config"`` and ``"drafters.dspark"``), seed 0, whatever that
    checkout calls the block size (``block_size``; older commits: ``gamma``) and the class
    (``DSparkDrafter``; older commits: ``Drafter``)."""
    import dataclasses

    from flax import nnx

    config_cls = mods["config"].DrafterConfig
    names = {f.name for f in dataclasses.fields(config_cls)}
    key = "block_size" if "block_size" in names else "gamma"
    cfg = config_cls.for_target(target_cfg, **{key: block_size}, **fields)
    module = mods["drafters.dspark"]
    cls = getattr(module, "DSparkDrafter", None) or module.Drafter
    return cls(cfg, nnx.Rngs(0))


def engine_for(engine_module: ModuleType, target: Any, drafter: Any, **settings: Any) -> Any:
    """A serving ``Engine`` of a checkout's ``serving.engine`` module (:func:`load_checkout`) with
    ``settings`` (one-shot prefill unless they say otherwise), whatever that checkout takes: an
    ``EngineConfig`` (the settings object), or, on older commits, the settings as keywords."""
    settings = {"prefill_chunk_tokens": 0, **settings}
    config_cls = getattr(engine_module, "EngineConfig", None)
    if config_cls is None:
        return engine_module.Engine(target, drafter, **settings)
    return engine_module.Engine(target, drafter, config_cls(**settings))
