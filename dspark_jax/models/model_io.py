"""Target-model files: format detection, config reading and loading with a tokenizer.

Formats (one module each, all returning the canonical parameters of
:mod:`dspark_jax.models.weights`): llama2.c ``.bin`` (:mod:`~dspark_jax.models.llama2c_io`),
GGUF (:mod:`~dspark_jax.models.gguf_io`) and Hugging Face safetensors directories
(:mod:`~dspark_jax.models.hf_io`). Each format also has a config-only reader
(:func:`llama2c_config`, :func:`gguf_config`, :func:`hf_config`; dispatch:
:func:`read_target_config`) that reads headers/metadata and never the weights; the loaders
call them, so a config is parsed by exactly one piece of code per format.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from dspark_jax.config import TargetConfig
from dspark_jax.errors import DSparkInputError
from dspark_jax.models.gguf_io import gguf_config, load_gguf, open_gguf
from dspark_jax.models.hf_io import hf_config, load_hf_dir
from dspark_jax.models.llama2c_io import is_tokenizer_bin, llama2c_config, load_llama2c
from dspark_jax.models.weights import Params

if TYPE_CHECKING:  # the tokenizer classes are imported when a model is loaded
    from dspark_jax.models.tokenizer import Tokenizer


def _llama2c_with_tokenizer(bin_path: Path) -> tuple[TargetConfig, Params, Tokenizer]:
    """A llama2.c checkpoint and the first ``tok*.bin`` / ``tokenizer.bin`` beside it whose
    vocabulary size matches.

    Raises:
      DSparkInputError: as :func:`~dspark_jax.models.llama2c_io.load_llama2c`, or no matching tokenizer.
    """
    from dspark_jax.models.tokenizer import Llama2cTokenizer

    cfg, params = load_llama2c(bin_path)
    cands = sorted(p for p in bin_path.parent.glob("*.bin") if is_tokenizer_bin(p))
    for p in cands:
        try:
            tok = Llama2cTokenizer.from_file(p)
        except DSparkInputError:
            continue
        if tok.vocab_size == cfg.vocab_size:
            return cfg, params, tok
    raise DSparkInputError(
        f"no llama2.c tokenizer with vocab {cfg.vocab_size} next to {bin_path.name}: expected a tok*.bin "
        f"or tokenizer.bin in {bin_path.parent} (found: {', '.join(p.name for p in cands) or 'none'})"
    )


_EXPECTED = (
    "expected a .gguf file, a llama2.c .bin checkpoint (with tok*.bin beside it), or a directory "
    "holding a Hugging Face config.json + *.safetensors, one .gguf, or a llama2.c .bin + tok*.bin"
)


def _model_kind(path: str | Path) -> tuple[str, Path]:
    """``("hf" | "gguf" | "llama2c", path)`` of a model path (format detection shared by the
    loader and the config reader).

    Raises:
      DSparkInputError: missing path or unrecognised contents.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise DSparkInputError(f"model path {p} does not exist; {_EXPECTED}")
    if p.is_dir():
        if (p / "config.json").is_file():
            return "hf", p
        ggufs = sorted(p.glob("*.gguf"))
        bins = sorted(b for b in p.glob("*.bin") if not is_tokenizer_bin(b))
        if len(ggufs) == 1:
            p = ggufs[0]
        elif len(ggufs) == 0 and len(bins) == 1:
            p = bins[0]
        else:
            found = ", ".join(x.name for x in ggufs + bins) or "nothing usable"
            raise DSparkInputError(f"cannot pick a model in directory {p} (found: {found}); {_EXPECTED}")
    if p.suffix == ".gguf":
        return "gguf", p
    if p.suffix == ".bin" and not is_tokenizer_bin(p):
        return "llama2c", p
    raise DSparkInputError(f"unrecognised model file {p}; {_EXPECTED}")


def read_target_config(path: str | Path) -> TargetConfig:
    """The :class:`TargetConfig` of a model path without loading its weights.

    Same formats and detection as :func:`load_target_files`; reads only the
    llama2.c header, the GGUF metadata, or the Hugging Face ``config.json`` (plus
    safetensors headers).

    Raises:
      DSparkInputError: missing path, unrecognised contents or an unreadable config.
    """
    kind, p = _model_kind(path)
    return {"hf": hf_config, "gguf": gguf_config, "llama2c": llama2c_config}[kind](p)


def load_target_files(path: str | Path) -> tuple[TargetConfig, Params, Tokenizer]:
    """Loads ``(cfg, params, tokenizer)`` from a path, detecting the format.

    Accepted: a ``.gguf`` file; a llama2.c ``.bin`` (its tokenizer is the
    ``tok*.bin``/``tokenizer.bin`` beside it whose vocabulary size matches); a
    directory with ``config.json`` (Hugging Face), exactly one ``.gguf``, or one
    llama2.c model ``.bin`` plus its tokenizer.

    Raises:
      DSparkInputError: missing path or unrecognised contents (the message says
        what was expected), plus any loader error.
    """
    from dspark_jax.models.tokenizer import HFTokenizer, gguf_tokenizer

    kind, p = _model_kind(path)
    if kind == "hf":
        cfg, params = load_hf_dir(p)
        return cfg, params, HFTokenizer(p)
    if kind == "gguf":
        reader = open_gguf(p)
        cfg, params = load_gguf(reader)
        return cfg, params, gguf_tokenizer(reader)
    return _llama2c_with_tokenizer(p)
