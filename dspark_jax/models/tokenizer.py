"""Tokenizers behind one small interface.

* :class:`Llama2cTokenizer` -- llama2.c ``tokenizer.bin`` (``run.c`` algorithm), also
  used for sentencepiece-style ("llama") GGUF vocabularies.
* :class:`BPETokenizer` -- GPT-2 byte-level BPE built with the ``tokenizers`` library
  from a GGUF file's ``tokenizer.ggml.*`` metadata (:func:`gguf_tokenizer`).
* :class:`HFTokenizer` -- a local Hugging Face tokenizer directory.

All return plain ``list[int]`` ids and render chat templates to a string (the
caller tokenizes it, special tokens included).
"""

from __future__ import annotations

import abc
import contextlib
import heapq
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dspark_jax.errors import DSparkInputError


class Tokenizer(abc.ABC):
    """Common tokenizer interface used by the decoding and training code."""

    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()
    add_bos_default: bool = False
    chat_template: str | None = None

    @abc.abstractmethod
    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Text -> ids. ``add_bos=None`` uses the model's default.

        Special-token strings in ``text`` (e.g. ``<|im_start|>``) become their ids
        for BPE/HF tokenizers, so rendered chat prompts tokenize correctly.
        """

    @abc.abstractmethod
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Ids -> text (invalid UTF-8 is replaced by U+FFFD)."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce."""

    def id_to_piece(self, i: int) -> str:
        """The vocabulary string of one id (as stored, not decoded)."""
        return self.decode([i])

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        """A fresh :class:`IncrementalDetokenizer` for one generated sequence.

        The default decodes a sliding window of a few ids per step (vLLM's prefix/read
        offsets); subclasses with a streaming decoder override it.
        """
        return _WindowDetokenizer(self, skip_special_tokens)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Renders ``messages`` (``[{"role", "content"}]``) with the model's template.

        Raises:
          DSparkInputError: the model has no chat template.
        """
        template = self.chat_template
        if not self.has_chat_template or not template:
            raise DSparkInputError(
                f"{type(self).__name__} has no chat template: pass a plain prompt instead of chat messages"
            )
        return render_chat_template(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._token_str(self.bos_id),
            eos_token=self._token_str(self.eos_ids[0] if self.eos_ids else None),
            **kwargs,
        )

    def _token_str(self, i: int | None) -> str:
        return "" if i is None else self.id_to_piece(i)


def render_chat_template(template: str, messages: list[dict], **kwargs: Any) -> str:
    """Renders a Hugging Face-style Jinja chat template the way transformers does.

    Same environment as ``transformers``: sandboxed, ``trim_blocks``,
    ``lstrip_blocks``, the ``loopcontrols`` extension, ``raise_exception`` and
    ``strftime_now`` globals and a ``tojson`` filter that keeps non-ASCII.
    """
    import datetime
    import json

    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise DSparkInputError(f"chat template error: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys
    )
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template).render(messages=messages, **kwargs)


# --------------------------------------------------------------------------- llama2.c


class Llama2cTokenizer(Tokenizer):
    """Score-ordered BPE over a sentencepiece vocabulary, exactly as llama2.c ``run.c``.

    Encoding: optional BOS, a dummy-prefix ``" "`` for non-empty text, one id per
    UTF-8 character (byte fallback ``<0xHH>`` otherwise), then repeatedly merge
    the adjacent pair whose concatenation is a piece with the highest score
    (leftmost on ties). Decoding: a piece right after BOS loses its leading
    space, ``<0xHH>`` pieces are raw bytes, BOS/EOS decode to ``""``.

    Args:
      pieces: piece bytes per id (sentencepiece ``▁`` already replaced by space).
      scores: merge score per id.
      bos_id, eos_id: special ids (llama2.c: 1 and 2).
      control_ids: ids that decode to ``""`` (BOS/EOS are always included).
      add_bos: default of ``encode(add_bos=None)``.
      add_dummy_prefix: prepend ``" "`` to non-empty text (run.c always does).
    """

    def __init__(
        self,
        pieces: Sequence[bytes],
        scores: Sequence[float],
        bos_id: int | None = 1,
        eos_id: int | None = 2,
        control_ids: Sequence[int] = (),
        add_bos: bool = True,
        add_dummy_prefix: bool = True,
    ):
        self.pieces = [bytes(p) for p in pieces]
        self.scores = [float(s) for s in scores]
        self.bos_id = bos_id
        self.eos_ids = () if eos_id is None else (int(eos_id),)
        self.add_bos_default = add_bos
        self.add_dummy_prefix = add_dummy_prefix
        self._lookup: dict[bytes, int] = {}
        for i, p in enumerate(self.pieces):
            self._lookup.setdefault(p, i)
        self._byte_ids = [self._lookup.get(b"<0x%02X>" % b) for b in range(256)]
        self._control = set(control_ids) | {i for i in (bos_id, eos_id) if i is not None}

    @classmethod
    def from_file(cls, path: str | Path) -> Llama2cTokenizer:
        """Reads a llama2.c ``tokenizer.bin``/``tok*.bin`` export.

        Layout: int32 ``max_token_length``, then per id float32 score, int32 length
        and the raw piece bytes. The vocabulary size is implied by the file size.

        Raises:
          DSparkInputError: missing, truncated or malformed file.
        """
        path = Path(path)
        try:
            data = path.read_bytes()
        except OSError as e:
            raise DSparkInputError(f"cannot read llama2.c tokenizer {path}: {e.strerror}") from None
        pieces, scores, off = [], [], 4
        try:
            (max_len,) = struct.unpack_from("<i", data, 0)
            while off < len(data):
                score, n = struct.unpack_from("<fi", data, off)
                off += 8
                if n < 0 or n > max(max_len, 64) or off + n > len(data):
                    raise struct.error
                pieces.append(data[off : off + n])
                scores.append(score)
                off += n
        except struct.error:
            raise DSparkInputError(
                f"{path} is not a valid llama2.c tokenizer file (truncated or corrupt at byte {off})"
            ) from None
        if len(pieces) < 3:
            raise DSparkInputError(f"{path} is not a valid llama2.c tokenizer file (only {len(pieces)} pieces)")
        return cls(pieces, scores)

    @property
    def vocab_size(self) -> int:
        return len(self.pieces)

    def id_to_piece(self, i: int) -> str:
        return self.pieces[i].decode("utf-8", errors="replace")

    def _byte_fallback(self, b: int) -> int:
        i = self._byte_ids[b]
        return b + 3 if i is None else i

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        add_bos = self.add_bos_default if add_bos is None else add_bos
        ids: list[int] = []
        if text and self.add_dummy_prefix:
            sp = self._lookup.get(b" ")
            ids.append(self._byte_fallback(32) if sp is None else sp)
        for ch in text:
            enc = ch.encode("utf-8", errors="surrogatepass")
            i = self._lookup.get(enc)
            if i is not None:
                ids.append(i)
            else:
                ids.extend(self._byte_fallback(b) for b in enc)
        ids = self._merge(ids)
        return ([self.bos_id] if add_bos and self.bos_id is not None else []) + ids

    def _merge(self, ids: list[int]) -> list[int]:
        # Linked list + lazy heap; (-score, left position) reproduces run.c's scan
        # (highest score, leftmost pair on ties) in O(n log n).
        n = len(ids)
        if n < 2:
            return ids
        tok = list(ids)
        nxt = list(range(1, n)) + [-1]
        prv = list(range(-1, n - 1))
        alive = [True] * n
        heap: list[tuple[float, int, int, int]] = []

        def push(i: int) -> None:
            j = nxt[i]
            if j >= 0:
                m = self._lookup.get(self.pieces[tok[i]] + self.pieces[tok[j]])
                if m is not None:
                    heapq.heappush(heap, (-self.scores[m], i, j, m))

        for i in range(n - 1):
            push(i)
        while heap:
            _, i, j, m = heapq.heappop(heap)
            if not (alive[i] and alive[j] and nxt[i] == j):
                continue
            if self._lookup.get(self.pieces[tok[i]] + self.pieces[tok[j]]) != m:
                continue  # stale entry: a side changed since it was pushed
            tok[i] = m
            alive[j] = False
            nxt[i] = nxt[j]
            if nxt[j] >= 0:
                prv[nxt[j]] = i
            if prv[i] >= 0:
                push(prv[i])
            push(i)
        return [tok[i] for i in range(n) if alive[i]]

    def piece_bytes(self, i: int, prev: int | None, skip_special_tokens: bool = False) -> bytes:
        """The bytes id ``i`` decodes to after id ``prev`` (``run.c`` rules): control ids (and
        id 0 when skipping special tokens) give ``b""``, a piece right after BOS loses its
        leading space, ``<0xHH>`` is one raw byte."""
        i = int(i)
        if i in self._control or (skip_special_tokens and i == 0):
            return b""
        p = self.pieces[i]
        if prev == self.bos_id and p[:1] == b" ":
            p = p[1:]
        if len(p) == 6 and p[:3] == b"<0x" and p[5:] == b">":
            with contextlib.suppress(ValueError):
                p = bytes([int(p[3:5], 16)])
        return p

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        out = bytearray()
        prev = None
        for i in ids:
            out += self.piece_bytes(i, prev, skip_special_tokens)
            prev = int(i)
        return out.decode("utf-8", errors="replace")

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return _Llama2cDetokenizer(self, skip_special_tokens)


# --------------------------------------------------------------------------- byte-level BPE


class BPETokenizer(Tokenizer):
    """Wraps a ``tokenizers.Tokenizer`` (GPT-2 byte-level BPE) plus special ids and template."""

    def __init__(
        self,
        tok: Any,
        bos_id: int | None,
        eos_ids: Sequence[int],
        add_bos: bool = False,
        chat_template: str | None = None,
    ):
        self.tok = tok
        self.bos_id = bos_id
        self.eos_ids = tuple(int(i) for i in eos_ids)
        self.add_bos_default = add_bos
        self.chat_template = chat_template

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def id_to_piece(self, i: int) -> str:
        return self.tok.id_to_token(int(i))

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        add_bos = self.add_bos_default if add_bos is None else add_bos
        ids = self.tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if add_bos and self.bos_id is not None else []) + list(ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return _StreamDetokenizer(self.tok, skip_special_tokens)


def _gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_tokenizer(reader: Any) -> Tokenizer:
    """Builds the tokenizer stored in a GGUF file's ``tokenizer.ggml.*`` metadata.

    ``tokenizer.ggml.model``:
      * ``gpt2``: byte-level BPE (``tokens`` + ``merges``). Pre-tokenizer by
        ``tokenizer.ggml.pre``: ``smollm`` = individual digits then the GPT-2
        regex; ``gpt2``/other = GPT-2 regex only. Token types 3 (control) and 4
        (user-defined) become special added tokens.
      * ``llama``: sentencepiece-style vocabulary with scores, encoded with the
        llama2.c algorithm (:class:`Llama2cTokenizer`).

    Args:
      reader: a ``gguf.GGUFReader`` or a path to a ``.gguf`` file.

    Raises:
      DSparkInputError: no or unsupported tokenizer in the file.
    """
    if isinstance(reader, (str, Path)):
        import gguf

        reader = gguf.GGUFReader(str(reader))
    model = _gguf_field(reader, "tokenizer.ggml.model")
    tokens = _gguf_field(reader, "tokenizer.ggml.tokens")
    if model is None or tokens is None:
        raise DSparkInputError("the GGUF file has no tokenizer (tokenizer.ggml.model/tokens missing)")
    types = _gguf_field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    bos = _gguf_field(reader, "tokenizer.ggml.bos_token_id")
    eos = _gguf_field(reader, "tokenizer.ggml.eos_token_id")
    eot = _gguf_field(reader, "tokenizer.ggml.eot_token_id")
    eos_ids = tuple(dict.fromkeys(int(i) for i in (eos, eot) if i is not None))
    template = _gguf_field(reader, "tokenizer.chat_template")
    if model == "llama":
        scores = _gguf_field(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens)
        add_bos = bool(_gguf_field(reader, "tokenizer.ggml.add_bos_token", True))
        pieces = [t.replace("\u2581", " ").encode("utf-8") for t in tokens]
        control = [i for i, t in enumerate(types) if t == 3]
        prefix = bool(_gguf_field(reader, "tokenizer.ggml.add_space_prefix", True))
        t = Llama2cTokenizer(pieces, scores, bos, eos, control_ids=control, add_bos=add_bos, add_dummy_prefix=prefix)
        t.chat_template = template
        return t
    if model != "gpt2":
        raise DSparkInputError(
            f"GGUF tokenizer model {model!r} is not supported (supported: 'gpt2' byte-level BPE, 'llama' sentencepiece)"
        )
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTok

    merges = _gguf_field(reader, "tokenizer.ggml.merges") or []
    vocab = {t: i for i, t in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False, ignore_merges=False)
    tok = HFTok(bpe)
    pre = _gguf_field(reader, "tokenizer.ggml.pre", "gpt2")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    special = [tokens[i] for i, t in enumerate(types) if t in (3, 4)]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in special])
    add_bos = bool(_gguf_field(reader, "tokenizer.ggml.add_bos_token", False))
    return BPETokenizer(tok, bos, eos_ids, add_bos=add_bos, chat_template=template)


# --------------------------------------------------------------------------- Hugging Face


class HFTokenizer(Tokenizer):
    """A local Hugging Face tokenizer (``AutoTokenizer.from_pretrained(local_dir)``).

    ``eos_ids`` joins the tokenizer's EOS with ``generation_config.json``'s
    ``eos_token_id`` (an int or a list) when that file exists.

    Raises:
      DSparkInputError: the directory has no loadable tokenizer.
    """

    def __init__(self, path: str | Path):
        import json

        from transformers import AutoTokenizer

        path = Path(path)
        try:
            self.tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DSparkInputError(f"cannot load a Hugging Face tokenizer from {path}: {msg}") from None
        self.bos_id = self.tok.bos_token_id
        eos = [self.tok.eos_token_id]
        gen = path / "generation_config.json"
        if gen.is_file():
            g = json.loads(gen.read_text()).get("eos_token_id")
            eos += g if isinstance(g, list) else [g]
        self.eos_ids = tuple(dict.fromkeys(int(i) for i in eos if i is not None))
        with_special = self.tok.encode("a", add_special_tokens=True)
        self.add_bos_default = bool(with_special) and self.bos_id is not None and with_special[0] == self.bos_id
        self.chat_template = getattr(self.tok, "chat_template", None)

    @property
    def vocab_size(self) -> int:
        return len(self.tok)

    def id_to_piece(self, i: int) -> str:
        return self.tok.convert_ids_to_tokens(int(i))

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        add_bos = self.add_bos_default if add_bos is None else add_bos
        ids = list(self.tok.encode(text, add_special_tokens=False))
        return ([self.bos_id] if add_bos and self.bos_id is not None else []) + ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        backend = getattr(self.tok, "backend_tokenizer", None)  # fast tokenizers only
        if backend is not None:
            return _StreamDetokenizer(backend, skip_special_tokens)
        return _WindowDetokenizer(self, skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        if not self.has_chat_template:
            raise DSparkInputError("this Hugging Face tokenizer has no chat template")
        return self.tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )


# --------------------------------------------------------------------------- incremental detokenization


class IncrementalDetokenizer(abc.ABC):
    """Turns one generated sequence's ids into text as they arrive, UTF-8-safe.

    :meth:`step` returns only complete characters: the bytes of a character split
    across tokens are held back until the token that completes it (a sequence that
    ends inside a character never shows the half character as U+FFFD). Each step
    costs O(1) in the length of the output (no re-decoding of the whole text).
    ``"".join(step(i) for i in ids)`` equals ``decode(ids)`` whenever ``ids`` ends on a
    character boundary. Build one with :meth:`Tokenizer.detokenizer`.
    """

    @abc.abstractmethod
    def step(self, token_id: int) -> str:
        """Feeds one id; returns the new complete text (possibly ``""``)."""

    def extend(self, token_ids: Sequence[int]) -> str:
        """Feeds several ids; returns their new complete text."""
        return "".join(self.step(int(i)) for i in token_ids)


class _Llama2cDetokenizer(IncrementalDetokenizer):
    """llama2.c pieces through an incremental UTF-8 decoder (``run.c``'s decode rules)."""

    def __init__(self, tok: Llama2cTokenizer, skip_special_tokens: bool):
        import codecs

        self.tok, self.skip = tok, skip_special_tokens
        self.prev: int | None = None
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def step(self, token_id: int) -> str:
        b = self.tok.piece_bytes(token_id, self.prev, self.skip)
        self.prev = int(token_id)
        return self.utf8.decode(b, final=False)


class _StreamDetokenizer(IncrementalDetokenizer):
    """``tokenizers.decoders.DecodeStream`` over a ``tokenizers.Tokenizer``."""

    def __init__(self, tok: Any, skip_special_tokens: bool):
        from tokenizers.decoders import DecodeStream

        self.tok = tok
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        return self.stream.step(self.tok, int(token_id)) or ""


class _WindowDetokenizer(IncrementalDetokenizer):
    """Any tokenizer: decodes a short window of recent ids per step (vLLM's offsets)."""

    def __init__(self, tok: Tokenizer, skip_special_tokens: bool):
        self.tok, self.skip = tok, skip_special_tokens
        self.ids: list[int] = []
        self.prefix = self.read = 0

    def step(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        before = self.tok.decode(self.ids[self.prefix : self.read], skip_special_tokens=self.skip)
        now = self.tok.decode(self.ids[self.prefix :], skip_special_tokens=self.skip)
        if len(now) > len(before) and not now.endswith("\ufffd") and now.startswith(before):
            self.prefix, self.read = self.read, len(self.ids)
            return now[len(before) :]
        return ""


def decode_complete(tokenizer: Tokenizer, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """The text of generated ``ids`` without a trailing partial character.

    Same as ``tokenizer.decode(ids, skip_special_tokens)`` except that bytes of a
    character the last tokens did not complete are dropped instead of showing as
    U+FFFD (a generation cut by a length limit or a stop). O(len(ids)).
    """
    return tokenizer.detokenizer(skip_special_tokens).extend(ids)
