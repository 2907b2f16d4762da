"""What a mixture-of-experts target costs per step: a random Qwen3-MoE-shaped target against a dense
target with the same active parameters, and the weight bytes its compiled feed-forward reads.

    python -m benchmarks.moe_cost --out /tmp/moe_cost.json

* timing: the batch-1 plain decode step (1 token) and a verification pass (``--verify`` tokens) of
  both targets through a KV cache, the four cases run in alternating order
  (:func:`benchmarks.harness.alternate`) so that a shared machine's load hits them alike; the
  ratio MoE / dense at one token is the figure (``<= 1.5`` means the step follows the active
  experts: a product over all E experts would cost about E / k times the dense one);
* bytes: one sparse layer's feed-forward (:func:`~dspark_jax.models.moe.moe_mlp`) compiled on its
  own at one token and at ``--verify`` tokens, against the bytes of the experts those tokens chose
  (router included). The weight bytes read are taken from the optimised HLO
  (:func:`weight_bytes_read`): an entry parameter consumed only through gathers or dynamic slices
  counts the slices taken, any other the whole array. XLA's ``cost_analysis()`` is reported beside it;
  it charges a fused gather's whole operand, so it over-counts the chosen experts' reads by ~E / k.

Random weights: the costs depend on shapes, not values. float32 on the CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any

from benchmarks.harness import alternate, command_line, device_description, markdown_table, ratio, write_json

_SHAPE = re.compile(r"(f32|bf16|f16|s32|u32|pred|s8|u8)\[([\d,]*)\]")
_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1}


def _nbytes(type_text: str) -> int:
    m = _SHAPE.search(type_text)
    if m is None:
        return 0
    n = 1
    for d in filter(None, m.group(2).split(",")):
        n *= int(d)
    return n * _BYTES[m.group(1)]


def weight_bytes_read(hlo_text: str) -> dict[str, int]:
    """Bytes each entry parameter of an optimised HLO module is read for: the output bytes of the
    gathers / dynamic slices that consume it (directly or as a fusion's parameter) when those
    are its only consumers, else its full size. Keys: the entry parameters' names."""
    comps: dict[str, list[str]] = {}
    name = None
    for line in hlo_text.splitlines():
        head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            name = "ENTRY" if head.group(1) else head.group(2)
            comps[name] = []
        elif name and line.strip().startswith(("%", "ROOT")):
            comps[name].append(line.strip().removeprefix("ROOT "))

    def slice_bytes(comp: str, param: str) -> int | None:
        """Bytes ``param`` (a name in ``comp``) is read for through slicing users only, else None."""
        total, users = 0, [ln for ln in comps[comp] if re.search(rf"[(,] ?%{re.escape(param)}[,)]", ln)]
        for ln in users:
            op = re.match(r"%[\w.\-]+ = (.*?) ([\w\-]+)\(", ln)
            if op is None:
                return None
            if op.group(2) in ("gather", "dynamic-slice"):
                total += _nbytes(op.group(1))
            elif op.group(2) == "fusion":
                called = re.search(r"calls=%([\w.\-]+)", ln)
                args = re.search(r"fusion\((.*?)\), kind", ln)
                if called is None or args is None:
                    return None
                idx = [a.strip().lstrip("%") for a in args.group(1).split(",")].index(param)
                inner = next((re.match(r"%([\w.\-]+) =", x).group(1) for x in comps[called.group(1)]
                              if re.search(rf"parameter\({idx}\)", x)), None)  # fmt: skip
                sub = None if inner is None else slice_bytes(called.group(1), inner)
                if sub is None:
                    return None
                total += sub
            else:
                return None
        return total

    out = {}
    for ln in comps.get("ENTRY", []):
        m = re.match(r"%([\w.\-]+) = (.*?) parameter\(", ln)
        if m:
            got = slice_bytes("ENTRY", m.group(1))
            out[m.group(1)] = _nbytes(m.group(2)) if got is None else got
    return out


def configs(a: argparse.Namespace) -> tuple[Any, Any]:
    """The MoE target's config and the dense one with the same active parameters (FFN k * Im)."""
    from dspark_jax.config import TargetConfig

    moe = TargetConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.experts_per_tok * a.expert_width,
                       num_layers=a.layers, num_heads=a.heads, num_kv_heads=a.kv_heads, head_dim=a.hidden // a.heads,
                       max_position=4096, qk_norm=True, tie_embeddings=False, name="moe", num_experts=a.experts,
                       num_experts_per_tok=a.experts_per_tok, moe_intermediate_size=a.expert_width,
                       norm_topk_prob=True)  # fmt: skip
    dense = dataclasses.replace(moe, name="dense", num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0)
    return moe, dense


def time_steps(targets: dict[str, Any], verify: int, cache_len: int, reps: int) -> list[dict[str, Any]]:
    """Median ms of the batch-1 cached pass of ``targets["moe"]`` and ``targets["dense"]`` at one token
    and at ``verify`` tokens (position ``cache_len / 2``), the four cases alternated; rows per token count."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    live, cases = cache_len // 2, {}
    for name, target in targets.items():
        graph, state = nnx.split(target)

        def step(state, cache, tok, pos, graph=graph):
            out = nnx.merge(graph, state)(tok, pos, cache=cache)
            return jnp.argmax(out.logits, axis=-1), out.cache

        for t in (1, verify):
            tok = jnp.asarray(np.random.default_rng(t).integers(0, target.cfg.vocab_size, (1, t)), jnp.int32)
            pos = jnp.arange(live, live + t, dtype=jnp.int32)[None]
            cache = target.init_cache(1, cache_len)
            exe = jax.jit(step).lower(state, cache, tok, pos).compile()

            def run(exe=exe, state=state, cache=cache, tok=tok, pos=pos):
                jax.block_until_ready(exe(state, cache, tok, pos))

            cases[f"{name}@{t}"] = run
    ms = {k: 1e3 * v for k, v in alternate(cases, reps, warmup=2).items()}
    rows = []
    for t in (1, verify):
        moe_ms, dense_ms = ms[f"moe@{t}"], ms[f"dense@{t}"]
        rows.append({"tokens": t, "moe_ms": moe_ms, "dense_ms": dense_ms, "moe_over_dense": ratio(moe_ms, dense_ms)})
    return rows


def layer_bytes(target: Any, verify: int) -> list[dict[str, Any]]:
    """The weight bytes the first sparse layer's feed-forward reads (:func:`weight_bytes_read` of its
    optimised HLO) at one token and at ``verify`` tokens, against the bytes of the experts those
    tokens chose plus the router's; rows per token count."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dspark_jax.models.moe import moe_mlp, route

    cfg, lay = target.cfg, target.layer_weights()
    p0 = {k: lay[k][0] for k in ("moe_router", "moe_gate", "moe_up", "moe_down")}
    item = p0["moe_gate"].dtype.itemsize
    per_expert = sum(int(np.prod(p0[k].shape[1:])) * item for k in ("moe_gate", "moe_up", "moe_down"))
    router = int(np.prod(p0["moe_router"].shape)) * item
    k, norm = cfg.num_experts_per_tok, cfg.norm_topk_prob
    rows = []
    for t in (1, verify):
        x = jnp.asarray(np.random.default_rng(10 + t).standard_normal((t, cfg.hidden_size)), p0["moe_gate"].dtype)
        compiled = jax.jit(lambda x, p: moe_mlp(x, p, k, norm)).lower(x, p0).compile()
        weights = sum(v for name, v in weight_bytes_read(compiled.as_text()).items() if not name.startswith("x"))
        chosen = len(set(np.asarray(route(x, p0["moe_router"], k, norm)[1]).ravel().tolist()))
        ca = compiled.cost_analysis()
        ca = ca[0] if isinstance(ca, list) else ca
        active = chosen * per_expert + router
        rows.append({"tokens": t, "experts_chosen": chosen, "active_expert_MB": active / 1e6,
                     "hlo_weight_MB_read": weights / 1e6, "read_over_active": ratio(weights, active),
                     "xla_cost_analysis_MB": float(ca["bytes accessed"]) / 1e6,
                     "all_experts_MB": (cfg.num_experts * per_expert + router) / 1e6})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.moe_cost", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--experts-per-tok", type=int, default=4)
    p.add_argument("--expert-width", type=int, default=256, help="moe_intermediate_size")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--verify", type=int, default=4, help="tokens of the verification pass")
    p.add_argument("--cache-len", type=int, default=256)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--out", default=None, help="JSON path")
    a = p.parse_args(argv)

    from dspark_jax.models.target import Target, random_params
    from dspark_jax.models.weights import count_target_params

    moe_cfg, dense_cfg = configs(a)
    targets = {
        "moe": Target(moe_cfg, random_params(moe_cfg, seed=0)),
        "dense": Target(dense_cfg, random_params(dense_cfg, seed=0)),
    }
    timing = time_steps(targets, a.verify, a.cache_len, a.reps)
    bytes_rows = layer_bytes(targets["moe"], a.verify)
    result = {
        "command": command_line("moe_cost", argv),
        "device": device_description(),
        "moe_config": moe_cfg.to_dict(),
        "dense_config": dense_cfg.to_dict(),
        "params": {
            n: {"total": count_target_params(t.cfg), "active": count_target_params(t.cfg, active=True)}
            for n, t in targets.items()
        },
        "timing": timing,
        "bytes": bytes_rows,
        "note": "the four timed cases alternate (benchmarks.harness.alternate) on a machine shared with other jobs",
    }
    print(markdown_table(timing))
    print()
    print(markdown_table(bytes_rows))
    if a.out:
        write_json(a.out, result)
    return result


if __name__ == "__main__":
    main()
