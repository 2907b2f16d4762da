"""What a process keeps on disk for the next one: measured cost tables and compiled programs.

``auto`` verification (the batch-1 costs) and the serving engine's throughput-aware policies
(the SPS table) decide from measured seconds, both kept in one kind of table
(:class:`~dspark_jax.decoding.cost_table.CostTable`). Measured afresh in every process, the same
prompt got different chosen lengths (so a different tau) from run to run, and every start paid
the measurement. The tables are stored here, keyed by everything the cost depends on (backend,
device kind, the model configs and dtypes, the cache length, the engine's shape, the spans, the
stored format, the jax and dspark_jax versions) and never by weight values (costs do not
depend on them). JAX's persistent compilation cache lives
beside them, so a second process skips most of the compiling too.

Location: ``DSPARK_CACHE_DIR`` (default ``~/.cache/dspark_jax``; ``off`` disables both caches);
the command-line tools' ``--cache-dir DIR|off`` sets it. ``DSPARK_REFRESH_COSTS=1`` (or
``--refresh-costs``) re-measures and overwrites the stored tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

__all__ = [
    "add_cache_arguments",
    "apply_cache_arguments",
    "cache_dir",
    "cost_key",
    "enable_compilation_cache",
    "load_costs",
    "refresh_requested",
    "save_costs",
    "set_cache_dir",
]

_log = logging.getLogger(__name__)
_OFF = ("off", "none", "0", "false", "no")


def cache_dir() -> Path | None:
    """The cache folder (``DSPARK_CACHE_DIR``, default ``~/.cache/dspark_jax``); None when off."""
    raw = os.environ.get("DSPARK_CACHE_DIR")
    if raw is None:
        return Path.home() / ".cache" / "dspark_jax"
    if raw.strip().lower() in _OFF or not raw.strip():
        return None
    return Path(raw).expanduser()


def set_cache_dir(value: str | None) -> None:
    """Sets ``DSPARK_CACHE_DIR`` for this process (a CLI's ``--cache-dir``); None leaves it."""
    if value is not None:
        os.environ["DSPARK_CACHE_DIR"] = value


def refresh_requested() -> bool:
    """Whether stored cost tables must be re-measured (``DSPARK_REFRESH_COSTS`` set and not off)."""
    raw = os.environ.get("DSPARK_REFRESH_COSTS", "")
    return bool(raw.strip()) and raw.strip().lower() not in _OFF


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dspark_jax")
    except PackageNotFoundError:
        return "0+unknown"


def _jsonable(x: Any) -> Any:
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: _jsonable(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return str(x)


def cost_key(kind: str, **fields: Any) -> dict:
    """The full key of a stored table: ``fields`` (model configs, dtypes, shapes; dataclasses
    are expanded) plus the backend, the first device's kind, the device count and the jax and
    dspark_jax versions. ``kind`` names the table (``"cost_table"``, ``"sps_table"``)."""
    import jax

    dev = jax.devices()[0]
    return {
        "kind": kind,
        "backend": jax.default_backend(),
        "device_kind": dev.device_kind,
        "device_count": jax.device_count(),
        "jax": jax.__version__,
        "dspark_jax": _version(),
        **{k: _jsonable(v) for k, v in sorted(fields.items())},
    }


def _path(key: dict) -> Path | None:
    root = cache_dir()
    if root is None:
        return None
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return root / "costs" / f"{key['kind']}-{digest}.json"


def load_costs(key: dict) -> dict | None:
    """The stored table of ``key`` (its JSON object), or None: no cache, none stored, a refresh
    requested, or an unreadable / mismatched file (logged, then measured again)."""
    path = _path(key)
    if path is None or refresh_requested() or not path.exists():
        return None
    try:
        obj = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        _log.warning("ignoring unreadable cost table %s (%s); measuring again", path, e)
        return None
    if not isinstance(obj, dict) or obj.get("key") != key or not isinstance(obj.get("table"), dict):
        _log.warning("ignoring cost table %s: it was stored for another key; measuring again", path)
        return None
    _log.info("loaded the %s from %s", key["kind"].replace("_", " "), path)
    return obj["table"]


def save_costs(key: dict, table: dict) -> Path | None:
    """Stores ``table`` (a JSON object) under ``key``, atomically; returns the path (None when
    the cache is off or the folder is not writable, which is logged and otherwise harmless)."""
    path = _path(key)
    if path is None:
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, "table": table}, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError as e:
        _log.warning("could not store the %s in %s: %s", key["kind"], path, e)
        return None
    return path


def enable_compilation_cache() -> Path | None:
    """Turns on JAX's persistent compilation cache in ``<cache dir>/jax`` for this process.

    Leaves an already configured ``jax_compilation_cache_dir`` alone; does nothing when the
    cache is off. Programs that compile in under 0.2 s are not stored (reading them back costs
    about as much). Returns the folder in use (None when off).
    """
    import jax

    current = getattr(jax.config, "jax_compilation_cache_dir", None)
    if current:
        return Path(current)
    root = cache_dir()
    if root is None:
        return None
    path = root / "jax"
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds ``--cache-dir DIR|off`` and ``--refresh-costs`` to a command-line tool."""
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="where measured cost tables and compiled programs are kept between runs (default "
        "$DSPARK_CACHE_DIR or ~/.cache/dspark_jax; 'off' disables both)",
    )
    parser.add_argument(
        "--refresh-costs",
        action="store_true",
        help="measure the cost tables again (and overwrite the stored ones)",
    )


def apply_cache_arguments(args: argparse.Namespace) -> Path | None:
    """Applies :func:`add_cache_arguments`' flags to this process and turns on the persistent
    compilation cache; returns its folder (None when off)."""
    set_cache_dir(getattr(args, "cache_dir", None))
    if getattr(args, "refresh_costs", False):
        os.environ["DSPARK_REFRESH_COSTS"] = "1"
    return enable_compilation_cache()
