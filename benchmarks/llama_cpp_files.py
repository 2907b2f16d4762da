"""The files of the llama.cpp check (``benchmarks.llama_cpp``): llama.cpp itself, built once from the
sources that PyPI's ``llama-cpp-python`` sdist vendors, the targets as Hugging Face folders, and
the GGUF files llama.cpp's own ``convert_hf_to_gguf.py`` makes of them and of a drafter export.

Layout of a llama.cpp folder (what :func:`build_llama_cpp` writes and :func:`llama_cpp_paths`
reads): ``src/`` (the vendored llama.cpp, with ``convert_hf_to_gguf.py`` and its ``gguf-py``),
``build/bin/`` (:data:`BUILD_TARGETS`, ``llama-server`` among them for ``serve/llamacpp.sh``) and ``READY``
(the bin folder, written last).

The converter imports ``sentencepiece`` for the stories260K and tiny-Qwen3 vocabularies (llama.cpp's
``requirements-convert_hf_to_gguf.txt``), besides torch, numpy and safetensors.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import numpy as np

LLAMA_CPP_PYTHON = "0.3.36"  # its sdist vendors llama.cpp with --spec-type draft-dspark
BUILD_TARGETS = ("llama-speculative-simple", "llama-completion", "llama-server")
ENV_VAR = "DSPARK_LLAMA_CPP"


# ----------------------------------------------------------------------------- llama.cpp


def llama_cpp_paths(root: str | Path) -> dict[str, Path]:
    """``{"src", "bin", "convert"}`` of a built llama.cpp folder.

    Raises:
      FileNotFoundError: a program of :data:`BUILD_TARGETS` or ``src/convert_hf_to_gguf.py`` is missing.
    """
    root = Path(root).expanduser().resolve()
    ready = root / "READY"
    bin_dir = Path(ready.read_text().strip()) if ready.is_file() else root / "build" / "bin"
    paths = {"src": root / "src", "bin": bin_dir, "convert": root / "src" / "convert_hf_to_gguf.py"}
    if not paths["convert"].is_file():
        raise FileNotFoundError(f"{root} is not a built llama.cpp folder: no {paths['convert']}")
    for t in BUILD_TARGETS:
        if not (bin_dir / t).is_file():
            build = bin_dir.parent  # build/bin's build folder
            raise FileNotFoundError(f"{root}: no {bin_dir / t} (build it: cmake --build {build} --target {t})")
    return paths


def build_llama_cpp(root: str | Path, jobs: int | None = None, log=print) -> dict[str, Path]:
    """Builds llama.cpp's CPU backend into ``root`` once (a folder with ``READY`` is reused).

    Downloads ``llama-cpp-python==LLAMA_CPP_PYTHON``'s sdist with pip (``--no-binary :all:``; an
    sdist already in ``root/dl/`` is reused), copies its ``vendor/llama.cpp`` to ``root/src`` and
    builds :data:`BUILD_TARGETS` with cmake and ninja, ``jobs`` in parallel (default: the number of
    cores): about 23 minutes with 2 jobs on a loaded 2-core machine.

    Raises:
      subprocess.CalledProcessError: pip, cmake or the build failed (their output is on stderr).
    """
    import shutil
    import time

    root = Path(root).expanduser().resolve()
    if (root / "READY").is_file():
        return llama_cpp_paths(root)
    root.mkdir(parents=True, exist_ok=True)
    dl = root / "dl"
    sdists = sorted(dl.glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        log(f"downloading llama-cpp-python=={LLAMA_CPP_PYTHON} (sdist)")
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        subprocess.run([*pip, f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(dl)], check=True)
        sdists = sorted(dl.glob("llama_cpp_python-*.tar.gz"))
    if not (root / "src").is_dir():
        with tarfile.open(sdists[-1]) as tar:
            tar.extractall(dl, filter="data")
        shutil.copytree(dl / sdists[-1].name.removesuffix(".tar.gz") / "vendor" / "llama.cpp", root / "src")
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF"]
    flags += ["-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_APP=OFF"]
    log(f"building llama.cpp ({', '.join(BUILD_TARGETS)}) in {root / 'build'}")
    subprocess.run(["cmake", "-S", str(root / "src"), "-B", str(root / "build"), "-G", "Ninja", *flags], check=True)
    jobs = jobs or os.cpu_count() or 1
    t0 = time.perf_counter()
    subprocess.run(["cmake", "--build", str(root / "build"), "-j", str(jobs), "--target", *BUILD_TARGETS], check=True)
    log(f"built in {time.perf_counter() - t0:.0f} s with {jobs} jobs")
    (root / "READY").write_text(str(root / "build" / "bin") + "\n")
    return llama_cpp_paths(root)


def llama_cpp_parser(prog: str, doc: str | None) -> Any:
    """An ``argparse`` parser for a llama.cpp benchmark ``prog`` (its description the first paragraph
    of ``doc``) with the two flags that find llama.cpp: ``--llama-cpp DIR`` (default
    ``DSPARK_LLAMA_CPP``) and ``--build DIR`` (:func:`locate_llama_cpp`)."""
    import argparse

    ap = argparse.ArgumentParser(
        prog=prog, description=(doc or "").split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--llama-cpp", default=os.environ.get(ENV_VAR), help=f"built llama.cpp folder (env {ENV_VAR})")
    ap.add_argument("--build", metavar="DIR", help="build llama.cpp into DIR first (once; reused when READY)")
    return ap


def locate_llama_cpp(build: str | None, given: str | None) -> dict[str, Path] | None:
    """The llama.cpp of a benchmark's ``--build DIR`` (built there first, once) or ``--llama-cpp DIR``
    (or ``DSPARK_LLAMA_CPP``, the flag's default); None, after a one-line error on stderr, without one.

    Raises:
      FileNotFoundError / subprocess.CalledProcessError: as :func:`llama_cpp_paths` / :func:`build_llama_cpp`.
    """
    if build:
        return build_llama_cpp(build, log=lambda m: print(m, file=sys.stderr))
    if given:
        return llama_cpp_paths(given)
    print(f"error: pass --llama-cpp DIR, set {ENV_VAR}, or --build DIR", file=sys.stderr)
    return None


def convert(llama: dict[str, Path], model_dir: Path, out: Path, target_dir: Path | None = None) -> Path:
    """``convert_hf_to_gguf.py model_dir --outtype f32 --outfile out`` (``--target-model-dir`` for a
    drafter); returns ``out`` (rewritten every time: the exports are rewritten too).

    Raises:
      RuntimeError: the converter failed (its last output lines in the message).
    """
    cmd = [sys.executable, str(llama["convert"]), str(model_dir), "--outtype", "f32", "--outfile", str(out)]
    if target_dir is not None:
        cmd += ["--target-model-dir", str(target_dir)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        tail = "\n".join((p.stdout + p.stderr).strip().splitlines()[-6:])
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {model_dir}:\n{tail}")
    return out


# ----------------------------------------------------------------------------- Hugging Face folders


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(num: int, wire: int, payload: bytes) -> bytes:
    key = _varint(num << 3 | wire)
    return key + (_varint(len(payload)) + payload if wire == 2 else payload)


def sentencepiece_model(pieces: list[bytes], scores: list[float]) -> bytes:
    """A sentencepiece ``ModelProto`` (BPE, byte fallback) of a llama2.c tokenizer's vocabulary.

    ``pieces[i]`` as ``tok*.bin`` stores them (spaces for ``▁``; id 0 ``<unk>``, 1 BOS, 2 EOS,
    ``<0xHH>`` byte pieces), ``scores[i]`` their merge scores. The protobuf is written field by
    field (sentencepiece_model.proto: ModelProto 1 pieces {1 piece, 2 score, 3 type}, 2 trainer_spec
    {3 model_type, 4 vocab_size, 35 byte_fallback, 40..43 unk/bos/eos/pad ids}, 3 normalizer_spec
    {1 name, 3 add_dummy_prefix, 4 remove_extra_whitespaces, 5 escape_whitespaces}).
    """
    normal, unknown, control, byte = 1, 2, 3, 6
    out = bytearray()
    for i, (p, s) in enumerate(zip(pieces, scores, strict=True)):
        if i == 0:
            text, kind = "<unk>", unknown
        elif i in (1, 2):
            text, kind = ("<s>", "</s>")[i - 1], control
        else:
            text = p.decode("utf-8", "replace")
            kind = byte if len(p) == 6 and p.startswith(b"<0x") and p.endswith(b">") else normal
            text = text if kind == byte else text.replace(" ", "\u2581")
        body = _field(1, 2, text.encode()) + _field(2, 5, struct.pack("<f", s)) + _field(3, 0, _varint(kind))
        out += _field(1, 2, body)
    trainer = _field(3, 0, _varint(2)) + _field(4, 0, _varint(len(pieces))) + _field(35, 0, _varint(1))
    trainer += _field(40, 0, _varint(0)) + _field(41, 0, _varint(1)) + _field(42, 0, _varint(2))
    trainer += _field(43, 0, _varint((1 << 64) - 1))  # pad_id -1 (int32 as a 64-bit varint)
    norm = _field(1, 2, b"identity") + _field(3, 0, b"\x01") + _field(4, 0, b"\x00") + _field(5, 0, b"\x01")
    return bytes(out + _field(2, 2, trainer) + _field(3, 2, norm))


def write_tokenizer(tokenizer: Any, out: Path) -> None:
    """``tokenizer.model`` (sentencepiece, for llama.cpp's converter) and ``tokenizer.json`` +
    ``tokenizer_config.json`` (transformers' Llama tokenizer of the same pieces and merges, which
    encodes TinyStories exactly as llama2.c's ``run.c``) in ``out``, from a
    :class:`~dspark_jax.models.tokenizer.Llama2cTokenizer`."""
    from tokenizers.models import BPE
    from transformers import LlamaTokenizer
    from transformers.convert_slow_tokenizer import SentencePieceExtractor

    (out / "tokenizer.model").write_bytes(sentencepiece_model(tokenizer.pieces, tokenizer.scores))
    kw: Any = SentencePieceExtractor(str(out / "tokenizer.model")).extract(BPE)  # a dict in transformers 5
    hf = LlamaTokenizer(vocab=kw["vocab"], merges=kw["merges"], legacy=True, add_bos_token=True)
    hf.save_pretrained(str(out))


def stories260k_hf_dir(out: Path) -> Path:
    """stories260K as a Hugging Face Llama folder (fp32 safetensors, its sentencepiece tokenizer
    rebuilt from ``tok512.bin``), written once."""
    from benchmarks.hf_baseline import hf_llama_from_params
    from dspark_jax.models.presets import resolve_target

    if (out / "config.json").is_file():
        return out
    cfg, params, tok = resolve_target("stories260k")
    out.mkdir(parents=True, exist_ok=True)
    hf_llama_from_params(cfg, params).save_pretrained(str(out))
    write_tokenizer(tok, out)
    return out


def tiny_qwen3_hf_dir(out: Path, seed: int = 0) -> Path:
    """A tiny untied Qwen3 (random weights written by transformers, fp32, 4 layers, width 64,
    stories260K's 512-token vocabulary and tokenizer), written once.

    The weights are drawn with ``initializer_range`` 0.5 so that greedy decoding is decided by clear
    margins, not by float rounding between two engines.
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dspark_jax.models.presets import resolve_target

    if (out / "config.json").is_file():
        return out
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        rope_theta=10000.0,  # pyright: ignore[reportCallIssue]  (a **kwargs field of Qwen3Config)
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        initializer_range=0.5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = Qwen3ForCausalLM(cfg).float().eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    write_tokenizer(resolve_target("stories260k")[2], out)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return out


def f32_gguf(src: Path, out: Path) -> Path:
    """``src`` (a quantized GGUF file) with every tensor dequantized to F32 and the same metadata
    (``general.file_type`` ALL_F32), written once: the weights dspark_jax's loader reads from ``src``
    (it dequantizes with the same ``gguf.quants.dequantize``), for llama.cpp at equal precision."""
    import gguf
    from gguf.quants import dequantize

    if out.is_file():
        return out
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    tmp = out.with_name(out.name + ".part")
    w = gguf.GGUFWriter(str(tmp), arch)
    skip = ("general.architecture", "general.alignment", "general.file_type")
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name in skip:
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for t in reader.tensors:
        a = dequantize(t.data, t.tensor_type).astype(np.float32)
        w.add_tensor(t.name, a.reshape(tuple(int(x) for x in reversed(t.shape))))  # GGUF lists dims innermost first
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(out)
    return out


def gguf_target_hf_dir(spec: str, out: Path) -> Path:
    """A Hugging Face folder of a GGUF target's config and tokenizer, no weights: what llama.cpp's
    converter reads from ``--target-model-dir`` for a drafter, written once from ``spec`` (a preset or
    ``.gguf`` path) through dspark_jax's loader.

    For a DSpark / DFlash drafter (``conversion/qwen.py``, ``DFlashModel``) the converter reads the
    target's ``config.json`` (whose architecture picks its tokenizer handler) and its tokenizer (its
    pre-tokenizer identified by hashing a test text's tokens: SmolLM2's as ``smollm``); target
    weights only for a drafter with a ``mask_embedding.pt``, which ours never ship. The tokenizer is
    dspark_jax's own: transformers 5's ``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` drops
    SmolLM2's digit split (``"\\n    288"`` tokenizes differently from llama.cpp and the model).

    Raises:
      ValueError: the target is not a plain-RoPE Llama or its tokenizer is not byte-level BPE.
    """
    from transformers import PreTrainedTokenizerFast

    from benchmarks.hf_baseline import hf_llama_config
    from dspark_jax.models.presets import resolve_target

    if (out / "config.json").is_file():
        return out
    cfg, _, tok = resolve_target(spec)
    backend = getattr(tok, "tok", None)
    if backend is None or not hasattr(backend, "to_str"):
        raise ValueError(f"{spec}: only a byte-level BPE tokenizer (tokenizers.Tokenizer) is written here")
    out.mkdir(parents=True, exist_ok=True)
    hc = hf_llama_config(cfg)
    hc.architectures = ["LlamaForCausalLM"]  # the converter picks its vocabulary handler by architecture
    hc.save_pretrained(str(out))
    piece = lambda i: None if i is None else tok.id_to_piece(i)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=piece(tok.bos_id),
        eos_token=piece(tok.eos_ids[0] if tok.eos_ids else None),
        chat_template=tok.chat_template,
    )
    fast.save_pretrained(str(out))
    return out


def gguf_tensor_names(path: Path) -> list[str]:
    """The tensor names of a GGUF file (with the ``gguf`` package)."""
    import gguf

    return [t.name for t in gguf.GGUFReader(str(path)).tensors]


def max_abs(a: Any, b: Any) -> float:
    """``max |a - b|`` as float32 arrays."""
    return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))
