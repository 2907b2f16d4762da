"""Fingerprints of the serving engine's compiled programs, to check that a refactor left the
traced computation unchanged.

    python -m benchmarks.engine_hlo --out /tmp/new.json
    PYTHONPATH=/path/to/old/checkout python benchmarks/engine_hlo.py --out /tmp/old.json
    python -m benchmarks.engine_hlo --compare /tmp/old.json /tmp/new.json

(The other checkout's run starts the script by its path: ``python -m`` would put the current
folder, and so this checkout's package, ahead of ``PYTHONPATH``.)
``tests/integration/test_engine_hlo.py`` runs both sides and the comparison against a base commit.

Runs a fixed small workload through :class:`Engine` (a tiny random-weight target and drafter
built from :class:`TargetConfig` / :class:`DrafterConfig` with fixed seeds; requests under the
``fixed`` and ``dspark`` policies, and ``plain`` until the drafter suspends, at temperature 0
and > 0, in a coupled and a rejection-sampling engine) with XLA dumping every module it
compiles (``XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text``, set before JAX is imported, with
the backend's optimisation turned down: :data:`FAST_COMPILE_FLAGS`).
Every ``*.before_optimizations.txt`` module is normalised (the ``HloModule`` name line, the
source tables and every ``metadata={...}`` attribute, i.e. Python source files, lines and op
names, removed; value and computation names, which carry Python identifiers, renamed in order
of appearance: :func:`normalise`) and hashed (SHA-256). Writes ``{"count": unique modules,
"hashes": sorted unique hashes, "modules": {hash: [program names]}, "package": the dspark_jax
folder measured}``. ``--compare A B`` lists
the modules only in A and only in B (exit status 1 when they differ, apart from the modules of a
program retired by a declared change and of its replacement, :data:`RETIRED`; ``--strict``
counts those too).

The package is imported from ``sys.path`` as found (no path is prepended) and the script imports
nothing else of this repository, so the same script measures any checkout: ``Engine``,
``Request`` and ``SamplingParams``, ``Target`` and the DSpark drafter class from whichever module of that
checkout holds them (:data:`ENGINE_MODULES` and :func:`_models`).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib
import json
import os
import re
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

# Where the engine and its request types live, newest layout first: a serving.engine package
# (or module), then the deprecated top-level shim of older commits.
ENGINE_MODULES = (
    "dspark_jax.serving.engine",
    "dspark_jax.serving.engine.engine",
    "dspark_jax.serving.engine.requests",
    "dspark_jax.serving.requests",
    "dspark_jax.engine",
)
# The modules hashed are XLA's input, before any optimisation: the backend's optimisation is turned
# down (it changes nothing hashed) so that the workload compiles in a fraction of the time. The last
# flag picks XLA CPU's older elemental emitters over its MLIR fusion emitters: the same programs
# compile in about half the time at this level (this workload 51 -> 27 s wall on 2 cores, session 14).
BASE_FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
FAST_COMPILE_FLAGS = f"{BASE_FAST_COMPILE_FLAGS} --xla_cpu_use_fusion_emitters=false"
_NAME = re.compile(r"^module_\d+\.(.+?)\.before_optimizations\.txt$")
# Programs retired by a declared change (``HLO-changed:``), each with the program that replaced it:
# a base from before the change compiles the retired one, a working tree after it the new one, so
# those modules cannot match; every other module (steps, catch-up, insert, row move, ...) must.
# Issue 25: one-shot prefill is now chunked prefill's degenerate pass.
RETIRED = {"jit_prefill_program": "jit_one_shot_pass_program"}
_SOURCE_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
_HLO_NAME = re.compile(r"(?<![\w.])[A-Za-z_][\w\-]*\.\d+(?![\w.])")


def fast_compile_flags() -> str:
    """:data:`FAST_COMPILE_FLAGS` if this XLA accepts them, else :data:`BASE_FAST_COMPILE_FLAGS`.

    XLA aborts on a flag it does not know, and JAX is not pinned: a fresh interpreter starts
    JAX's CPU backend with the flags once (about 2 s) to find out.
    """
    import subprocess

    env = {**os.environ, "XLA_FLAGS": FAST_COMPILE_FLAGS, "JAX_PLATFORMS": "cpu"}
    probe = [sys.executable, "-c", "import jax.numpy as jnp; jnp.zeros(1).block_until_ready()"]
    ok = subprocess.run(probe, env=env, capture_output=True, timeout=300).returncode == 0
    return FAST_COMPILE_FLAGS if ok else BASE_FAST_COMPILE_FLAGS


def with_fast_compile(flags: str) -> str:
    """``flags`` (an ``XLA_FLAGS`` value) with :func:`fast_compile_flags` appended, or unchanged when
    they already set the optimisation level (as the test suite's environment does: no second probe)."""
    if "xla_backend_optimization_level" in flags:
        return flags
    return f"{flags} {fast_compile_flags()}".strip()


def strip_metadata(text: str) -> str:
    """``text`` without the ``HloModule`` line (it holds the program's name), the source tables
    (``FileNames``, ``FunctionNames``, ``FileLocations``, ``StackFrames``: Python files, functions
    and lines) and every ``metadata={...}`` attribute (op names, source lines, stack frame ids;
    balanced braces, quoted strings skipped while scanning)."""
    lines, skipping = [], False
    for ln in text.splitlines():
        if ln in _SOURCE_TABLES:  # a table of source files / functions / lines, up to a blank line
            skipping = True
        elif skipping and not ln.strip():
            skipping = False
        elif not skipping and not ln.startswith("HloModule "):
            lines.append(ln)
    text = "\n".join(lines)
    out, i = [], 0
    while True:
        j = text.find("metadata={", i)
        if j < 0:
            out.append(text[i:])
            break
        start = j - 2 if text[j - 2 : j] == ", " else j  # the attribute's separator goes too
        out.append(text[i:start])
        k, depth, quoted = j + len("metadata="), 0, False
        while k < len(text):
            c = text[k]
            if quoted:
                if c == "\\":
                    k += 1
                elif c == '"':
                    quoted = False
            elif c == '"':
                quoted = True
            elif c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    break
            k += 1
        i = k + 1
    return "".join(out)


def canonical_names(text: str) -> str:
    """Renames every HLO value and computation name (``name.N``) to ``vK``, K its order of
    first appearance. Names carry Python identifiers (the traced function's name and argument
    names, and, through JAX's lowering cache, the name of whichever program first lowered a
    shared helper such as ``threefry2x32``), not computation: the renamed text still pins
    every op, shape, operand, attribute and their order."""
    names: dict[str, str] = {}

    def rename(m: re.Match) -> str:
        return names.setdefault(m.group(0), f"v{len(names)}")

    return _HLO_NAME.sub(rename, text)


def normalise(text: str) -> str:
    """:func:`strip_metadata`, then :func:`canonical_names`: what is hashed."""
    return canonical_names(strip_metadata(text))


def fingerprints(dump_dir: Path) -> dict:
    """``{count, hashes, modules}`` of every ``*.before_optimizations.txt`` in ``dump_dir``."""
    names: dict[str, set[str]] = {}
    for path in sorted(dump_dir.glob("*.before_optimizations.txt")):
        digest = hashlib.sha256(normalise(path.read_text()).encode()).hexdigest()
        m = _NAME.match(path.name)
        names.setdefault(digest, set()).add(m.group(1) if m else path.name)
    return {
        "count": len(names),
        "hashes": sorted(names),
        "modules": {h: sorted(v) for h, v in sorted(names.items())},
    }


def _find(name: str, *modules: str):
    """Attribute ``name`` of the first of ``modules`` that imports and defines it."""
    for mod in modules:
        try:
            obj = getattr(importlib.import_module(mod), name, None)
        except ImportError:
            continue
        if obj is not None:
            return obj
    raise ImportError(f"none of {modules} defines {name}")


def _models():
    """A tiny random target and a DSpark drafter for it (fixed seeds), on any checkout."""
    from flax import nnx

    from dspark_jax.config import DrafterConfig, TargetConfig

    # The subpackage layout, then the flat one of older commits (import by name: a static import
    # of a module that no longer exists would not resolve).
    target_cls = _find("Target", "dspark_jax.models.target", "dspark_jax.target")
    random_params = _find("random_params", "dspark_jax.models.target", "dspark_jax.target")
    try:
        drafter_cls = _find("DSparkDrafter", "dspark_jax.drafters.dspark")
    except ImportError:  # older commits: the class was called Drafter
        drafter_cls = _find("Drafter", "dspark_jax.drafters.dspark", "dspark_jax.drafter")

    cfg = TargetConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position=256,
        name="hlo-tiny",
    )
    target = target_cls(cfg, random_params(cfg, seed=0), fingerprint="hlo-tiny")
    # The block size's field name on this checkout (older commits: gamma).
    block_key = "block_size" if "block_size" in {f.name for f in dataclasses.fields(DrafterConfig)} else "gamma"
    block: dict[str, Any] = {block_key: 3}
    dcfg = DrafterConfig.for_target(
        cfg, **block, num_layers=1, intermediate_size=64, markov_rank=16, target_fingerprint="hlo-tiny"
    )
    return target, drafter_cls(dcfg, nnx.Rngs(0))


def _drive(engine, requests) -> None:
    """Requests one per step into the highest free slot, until all finished."""
    pending = list(requests)
    while pending or engine.active_slots():
        free = engine.free_slots()
        if pending and free:
            engine.insert(engine.prefill(pending.pop(0)), free[-1])
        engine.generate()


def workload() -> None:
    """The fixed workload: every program a coupled and a rejection engine compile."""
    with warnings.catch_warnings():  # dspark_jax.engine, where it is the one found, is deprecated
        warnings.simplefilter("ignore", DeprecationWarning)
        engine_cls, request_cls, params_cls = (
            _find(n, *ENGINE_MODULES) for n in ("Engine", "Request", "SamplingParams")
        )

    target, drafter = _models()
    prompts = [[1, 5, 9, 13, 17], [1, 7, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]]
    settings = [
        dict(temperature=0.0, max_tokens=12, seed=0),
        dict(temperature=1.0, top_k=20, max_tokens=10, seed=3),
        dict(temperature=0.7, top_p=0.9, max_tokens=14, seed=5, logprobs=2, logit_bias=((7, -2.0),), min_tokens=2),
    ]
    if "max_new_tokens" in {f.name for f in dataclasses.fields(params_cls)}:  # older commits: max_tokens
        settings = [{("max_new_tokens" if k == "max_tokens" else k): v for k, v in s.items()} for s in settings]
    reqs = [request_cls(p, params_cls(**s), f"r{i}") for i, (p, s) in enumerate(zip(prompts, settings))]
    common = dict(num_slots=2, cache_len=64, buckets=(8,), prefill_buckets=(16, 32), profile_iters=1)
    try:
        config_cls = _find("EngineConfig", *ENGINE_MODULES)
    except ImportError:  # older commits: the settings were the engine's keywords

        def engine(**kw):
            return engine_cls(target, drafter, **kw)
    else:

        def engine(**kw):  # one-shot prefill, as the keywords' default was
            return engine_cls(target, drafter, config_cls(prefill_chunk_tokens=0, **kw))

    eng = engine(policy="fixed:3", suspend_after=2, **common)
    for policy in ("fixed:3", "dspark", "plain", "fixed:3"):  # plain suspends the drafter, fixed resumes it
        eng.set_policy(policy)
        _drive(eng, reqs)
    rej = engine(policy="fixed:3", suspend_after=None, verification="rejection", **common)
    _drive(rej, reqs)


def _retired_modules(a: dict, b: dict, only_a: list[str], only_b: list[str], retired: dict) -> set[str]:
    """The hashes among ``only_a`` / ``only_b`` that a retired program explains: modules of a
    program of ``retired`` found only in A while B compiles its replacement (and none of the
    retired one), and modules of that replacement found only in B."""
    names_a, names_b = ({n for ns in side.get("modules", {}).values() for n in ns} for side in (a, b))
    pairs = {(old, new) for old, new in retired.items() if old in names_a and old not in names_b and new in names_b}
    olds, news = {old for old, _ in pairs}, {new for _, new in pairs}
    explained = {h for h in only_a if set(a.get("modules", {}).get(h, ["?"])) <= olds}
    return explained | {h for h in only_b if set(b.get("modules", {}).get(h, ["?"])) <= news}


def compare(a_path: str, b_path: str, retired: dict | None = None) -> int:
    """Prints the modules only in A and only in B; 0 when both hold the same modules, apart from
    those of programs ``retired`` (default :data:`RETIRED`; ``{}``: strict) replaced between A and
    B, which are listed as such."""
    a, b = (json.loads(Path(p).read_text()) for p in (a_path, b_path))
    only_a = sorted(set(a["hashes"]) - set(b["hashes"]))
    only_b = sorted(set(b["hashes"]) - set(a["hashes"]))
    common = len(set(a["hashes"]) & set(b["hashes"]))
    explained = _retired_modules(a, b, only_a, only_b, RETIRED if retired is None else retired)
    print(f"{a_path}: {a['count']} modules; {b_path}: {b['count']} modules; common {common}")
    for label, side, hashes in (("only in A", a, only_a), ("only in B", b, only_b)):
        print(f"{label}: {len(hashes)}")
        for h in hashes:
            note = f"  ({'retired' if side is a else 'its replacement'}: see RETIRED)" if h in explained else ""
            print(f"  {h[:16]}  {', '.join(side.get('modules', {}).get(h, []))}{note}")
    return 0 if set(only_a + only_b) <= explained else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.engine_hlo", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--out", default="engine_hlo.json", help="JSON of the module hashes (default engine_hlo.json)")
    p.add_argument("--dump-dir", default=None, help="XLA dump folder (default: a temporary one, removed)")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two JSON files instead of running")
    p.add_argument("--strict", action="store_true", help="with --compare: retired programs must match too")
    p.add_argument("--from-dump", default=None, metavar="DIR", help="hash an existing XLA dump instead of running")
    args = p.parse_args(argv)
    if args.compare:
        return compare(*args.compare, retired={} if args.strict else None)
    if args.from_dump:
        res = fingerprints(Path(args.from_dump))
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
        print(f"{res['count']} modules -> {args.out}")
        return 0
    if "jax" in sys.modules:
        raise RuntimeError("engine_hlo: JAX was imported before XLA_FLAGS was set")
    with tempfile.TemporaryDirectory() as tmp:
        dump = Path(args.dump_dir or tmp)
        dump.mkdir(parents=True, exist_ok=True)
        fast = with_fast_compile(os.environ.get("XLA_FLAGS", ""))
        os.environ["XLA_FLAGS"] = f"{fast} --xla_dump_to={dump} --xla_dump_hlo_as_text".strip()
        import jax

        import dspark_jax

        jax.config.update("jax_enable_compilation_cache", False)  # a cache hit would skip the dump
        workload()
        res = fingerprints(dump)
        res["package"] = str(Path(dspark_jax.__file__).resolve().parent)  # which checkout was measured
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(f"{res['count']} modules -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
