"""The serving CLI's checks before anything loads or compiles, shared by ``serve --dry-run`` and
the real start, so that a dry run refuses what the start refuses, with the same line.

:func:`check_server_arguments` checks the settings alone; :func:`check_plan` checks the target's
config against the drafter's (:func:`~dspark_jax.drafters.base.check_compatible_config`:
vocabulary, hidden size, tapped layers), the drafter kind the engine serves, the policy against
the drafter's block size and the engine's shape. The real start runs it on the loaded target's
config (its weights fingerprint too) before it loads the drafter; :func:`print_plan` (the dry
run) on the configs read from the files' headers and metadata, without weights or devices:
what only the weights (their fingerprint) or the devices (the mesh's device count, the compiled
programs) can tell is checked at the real start only.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from dspark_jax.errors import DSparkInputError
from dspark_jax.serving.config import EngineConfig

__all__ = ["check_plan", "check_server_arguments", "parse_buckets", "print_plan", "read_chat_template"]


def parse_buckets(spec: str | None, flag: str = "--buckets") -> tuple[int, ...] | None:
    """The engine's token-budget buckets from ``--buckets`` (comma-separated integers, the
    serving CLI's and the serving benchmarks' spelling; also ``--profile-spans``, named by
    ``flag`` in errors): sorted, deduplicated; None when empty.

    Raises:
      DSparkInputError: not integers, or a value below 1.
    """
    if not spec:
        return None
    try:
        out = tuple(sorted({int(x) for x in spec.split(",") if x.strip()}))
    except ValueError:
        raise DSparkInputError(f"{flag} {spec!r}: expected comma-separated integers") from None
    if not out or out[0] < 1:
        raise DSparkInputError(f"{flag} {spec!r}: values must be positive")
    return out


def read_chat_template(path: str | None) -> str | None:
    """The text of ``--chat-template FILE`` (None without the flag).

    Raises:
      DSparkInputError: the file does not exist.
    """
    if not path:
        return None
    if not Path(path).is_file():
        raise DSparkInputError(f"--chat-template file not found: {Path(path)}")
    return Path(path).read_text(encoding="utf-8")


def check_server_arguments(args: argparse.Namespace) -> str | None:
    """One-line refusals of bad server settings before anything loads; returns the API key
    (``--api-key``, else ``DSPARK_API_KEY``, else None).

    Raises:
      DSparkInputError: a bad setting, named.
    """
    if args.max_queue < 0:
        raise DSparkInputError("--max-queue must be >= 0")
    if args.max_request_bytes is not None and args.max_request_bytes < 0:
        raise DSparkInputError("--max-request-bytes must be >= 0 (0: no limit)")
    if args.default_max_tokens is not None and args.default_max_tokens < 1:
        raise DSparkInputError("--default-max-tokens must be >= 1")
    api_key = args.api_key if args.api_key is not None else os.environ.get("DSPARK_API_KEY")
    if args.api_key_health_metrics and not api_key:
        raise DSparkInputError("--api-key-health-metrics needs --api-key (or DSPARK_API_KEY)")
    if not 0 < args.port < 65536:
        raise DSparkInputError("--port must be in 1..65535")
    if args.policy and args.policy.strip().lower() != "plain" and not args.drafter:
        raise DSparkInputError(f"policy {args.policy!r} needs a drafter (--drafter EXPORT_DIR); use --policy plain")
    return api_key


def check_engine_shape(num_slots: int, cache_len: int) -> None:
    """Refuses an engine of fewer than one slot or a cache shorter than 2 positions.

    Raises:
      DSparkInputError: named after the CLI flag.
    """
    if num_slots < 1:
        raise DSparkInputError("--num-slots must be >= 1")
    if cache_len < 2:
        raise DSparkInputError("--cache-len must be >= 2")


def check_plan(args: argparse.Namespace, tcfg, dcfg=None, fingerprint: str = "") -> str:
    """The checks of the target/drafter pairing and the engine's settings that the configs
    decide; returns the policy (``--policy``, else ``dspark`` with a drafter, ``plain`` without).

    Args:
      tcfg: the target's :class:`~dspark_jax.config.TargetConfig`.
      dcfg: the drafter's :class:`~dspark_jax.config.DrafterConfig` (None: no drafter).
      fingerprint: the target's weights fingerprint ("" when the weights are not loaded).
    Raises:
      DSparkInputError: a drafter for another target (vocabulary, hidden size, layers, weights),
        a drafter kind the engine cannot serve, a policy the drafter cannot run, bad slots, cache
        length, buckets, prefill chunk or drafter suspension.
    """
    from dspark_jax.drafters.base import check_compatible_config
    from dspark_jax.serving.engine.device import EngineDevice
    from dspark_jax.serving.engine.planner import parse_policy

    EngineDevice.check_servable(None, tcfg)
    if dcfg is not None:
        check_compatible_config(tcfg, dcfg, fingerprint)
        EngineDevice.check_servable(dcfg)
    policy = EngineConfig(policy=args.policy).policy_for(dcfg is not None)
    parse_policy(policy, dcfg.block_size if dcfg is not None else 0)
    check_engine_shape(args.num_slots, args.cache_len)
    parse_buckets(args.buckets)
    parse_buckets(args.profile_spans, "--profile-spans")
    if args.prefill_chunk_tokens < 0:
        n = args.prefill_chunk_tokens
        raise DSparkInputError(f"--prefill-chunk-tokens must be >= 0 (0: one-shot prefill), got {n}")
    if args.suspend_after < -1:
        raise DSparkInputError(f"--suspend-after must be >= 0, or -1 (never suspend), got {args.suspend_after}")
    return policy


def print_plan(args: argparse.Namespace) -> dict[str, Any]:
    """``--dry-run``: the server ``args`` would start, checked as the real start checks it
    (:func:`check_server_arguments`, :func:`check_plan`) and resolved without weights or
    devices (nothing is compiled), printed as JSON.

    Returns:
      The plan: target (name, layers, vocabulary), drafter (variant, block size) or None, policy,
      engine shape, request limits, ``model`` mesh size (1: one device), bind address.
    Raises:
      DSparkInputError: what :func:`check_server_arguments` and :func:`check_plan` refuse, an
        unreadable drafter export or chat template, a bad mesh.
    """
    from dspark_jax.drafters.checkpoint import export_config, read_export_meta
    from dspark_jax.models.presets import target_config
    from dspark_jax.models.sharding import parse_mesh
    from dspark_jax.serving.http.protocol import default_max_request_bytes

    check_server_arguments(args)
    dcfg = export_config(read_export_meta(args.drafter), args.drafter) if args.drafter else None
    read_chat_template(args.chat_template)
    tcfg = target_config(args.target)
    policy = check_plan(args, tcfg, dcfg)
    try:
        mesh = parse_mesh(args.mesh) if args.mesh else {}
    except ValueError as e:
        raise DSparkInputError(str(e)) from None
    if mesh.get("data", 1) * mesh.get("fsdp", 1) > 1:
        raise DSparkInputError(f"serving shards over 'model' only; got mesh {args.mesh}")
    context = min(args.cache_len, tcfg.max_position)
    plan = {
        "target": {"spec": args.target, "name": tcfg.name, "layers": tcfg.num_layers, "vocab": tcfg.vocab_size},
        "drafter": None
        if dcfg is None
        else {"path": args.drafter, "variant": dcfg.variant, "block_size": dcfg.block_size},
        "policy": policy,
        "verification": args.verification,
        "num_slots": args.num_slots,
        "cache_len": args.cache_len,
        "buckets": parse_buckets(args.buckets),
        "prefill_chunk_tokens": args.prefill_chunk_tokens,
        "plan_ahead": args.plan_ahead,
        "max_request_bytes": default_max_request_bytes(context)
        if args.max_request_bytes is None
        else (args.max_request_bytes or None),
        "dtype": args.dtype,
        "mesh_model": mesh.get("model", 1) if args.mesh else 1,
        "url": f"http://{args.host}:{args.port}",
    }
    print(json.dumps(plan, indent=2))
    return plan
