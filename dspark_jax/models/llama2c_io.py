"""llama2.c legacy (version-0) float32 checkpoints (Karpathy's ``run.c`` layout).

:func:`llama2c_config` reads only the 28-byte header (and the file size);
:func:`load_llama2c` returns the canonical parameters of :mod:`dspark_jax.models.weights`,
q/k rows permuted from adjacent-pair to half RoPE.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dspark_jax.config import TargetConfig
from dspark_jax.errors import DSparkInputError
from dspark_jax.models.weights import Params, adjacent_to_half


def _llama2c_layout(path: Path) -> tuple[TargetConfig, list[tuple[str, tuple[int, ...]]]]:
    """Config and tensor layout of a llama2.c checkpoint from its 28-byte header and file size."""
    try:
        with open(path, "rb") as f:
            head = f.read(28)
        size = path.stat().st_size
    except OSError as e:
        raise DSparkInputError(f"cannot read llama2.c checkpoint {path}: {e.strerror}") from None
    if len(head) < 28:
        raise DSparkInputError(f"{path} is too small to be a llama2.c checkpoint ({size // 4 * 4} bytes)")
    hdr = np.frombuffer(head, dtype="<i4").astype(np.int64)
    if int(hdr[0]) == 0x616B3432:
        raise DSparkInputError(
            f"{path} is a versioned llama2.c export (magic 'ak42'); only the legacy version-0 export is supported"
        )
    dim, hidden, L, nh, nkv, vocab, seq = (int(x) for x in hdr)
    shared = vocab > 0
    vocab = abs(vocab)
    if min(dim, hidden, L, nh, nkv, vocab, seq) <= 0 or dim % nh or nh % nkv or (dim // nh) % 2:
        raise DSparkInputError(f"{path}: invalid llama2.c header {hdr.tolist()} (not a llama2.c checkpoint?)")
    hd = dim // nh
    kv = nkv * hd
    sizes = [
        ("embed", (vocab, dim)),
        ("attn_norm", (L, dim)),
        ("wq", (L, dim, dim)),
        ("wk", (L, kv, dim)),
        ("wv", (L, kv, dim)),
        ("wo", (L, dim, dim)),
        ("mlp_norm", (L, dim)),
        ("w1", (L, hidden, dim)),
        ("w2", (L, dim, hidden)),
        ("w3", (L, hidden, dim)),
        ("final_norm", (dim,)),
        ("freq_cis", (2, seq, hd // 2)),
    ] + ([] if shared else [("wcls", (vocab, dim))])
    expected = 7 + sum(int(np.prod(s)) for _, s in sizes)
    if size != expected * 4:
        raise DSparkInputError(
            f"{path}: llama2.c checkpoint is {size} bytes but its header "
            f"(dim={dim} hidden={hidden} layers={L} heads={nh}/{nkv} vocab={vocab} seq={seq}) "
            f"implies {expected * 4} bytes (truncated or corrupt file)"
        )
    cfg = TargetConfig(
        vocab_size=vocab,
        hidden_size=dim,
        intermediate_size=hidden,
        num_layers=L,
        num_heads=nh,
        num_kv_heads=nkv,
        head_dim=hd,
        max_position=seq,
        rope_theta=10000.0,
        rms_eps=1e-5,
        tie_embeddings=shared,
        qk_norm=False,
        bos_id=1,
        eos_ids=(1, 2),
        name=path.stem,
    )
    return cfg, sizes


def llama2c_config(bin_path: str | Path) -> TargetConfig:
    """The :class:`TargetConfig` of a llama2.c checkpoint (header and file size only).

    Raises:
      DSparkInputError: as :func:`load_llama2c`.
    """
    return _llama2c_layout(Path(bin_path))[0]


def load_llama2c(bin_path: str | Path) -> tuple[TargetConfig, Params]:
    """Loads a llama2.c legacy (version-0) float32 checkpoint (``run.c`` layout).

    Header: 7 little-endian int32 ``dim, hidden_dim, n_layers, n_heads,
    n_kv_heads, vocab_size, seq_len`` (negative vocab = separate classifier at
    the end); then float32 ``[out, in]`` weights in run.c order; the legacy
    ``freq_cis`` tables are skipped. ``eos_ids = (1, 2)``: run.c stops when BOS
    is generated. RMSNorm eps 1e-5, RoPE theta 10000.

    Raises:
      DSparkInputError: unreadable file, a versioned (``ak42``) export, or a
        size that does not match the header (truncated/corrupt).
    """
    path = Path(bin_path)
    cfg, sizes = _llama2c_layout(path)
    nh, nkv, shared = cfg.num_heads, cfg.num_kv_heads, cfg.tie_embeddings
    try:
        raw = np.fromfile(path, dtype="<f4")
    except OSError as e:
        raise DSparkInputError(f"cannot read llama2.c checkpoint {path}: {e.strerror}") from None
    w, off = {}, 7
    for name, shape in sizes:
        n = int(np.prod(shape))
        w[name] = raw[off : off + n].reshape(shape)
        off += n
    T = lambda a: np.ascontiguousarray(np.swapaxes(a, -1, -2))
    layers = {
        "attn_norm": w["attn_norm"].copy(),
        "wq": T(np.stack([adjacent_to_half(m, nh) for m in w["wq"]])),
        "wk": T(np.stack([adjacent_to_half(m, nkv) for m in w["wk"]])),
        "wv": T(w["wv"]),
        "wo": T(w["wo"]),
        "mlp_norm": w["mlp_norm"].copy(),
        "w_gate": T(w["w1"]),
        "w_up": T(w["w3"]),
        "w_down": T(w["w2"]),
    }
    params = {"embed": w["embed"].copy(), "layers": layers, "final_norm": w["final_norm"].copy()}
    if not shared:
        params["lm_head"] = T(w["wcls"])
    return cfg, params


def is_tokenizer_bin(p: Path) -> bool:
    """Whether ``p`` is a llama2.c tokenizer file (``tok*.bin`` / ``tokenizer.bin``), not a model."""
    return p.suffix == ".bin" and (p.name.startswith("tok") or p.name == "tokenizer.bin")
