"""``python -m benchmarks.speed_table`` end to end on stories260K with a tiny random drafter (CI-sized:
two prompt sets of one prompt, 8 new tokens, both temperatures, ``auto`` only: compiling its loop
and cost table is most of the run; fixed lengths go through the same bound, and their width mix
is checked in tests/unit/test_decode.py). Only the run, the JSON's shape and what must hold
whatever the timings are checked: lossless tokens at T=0, tau, bound = tau * T_step / (T_draft +
T_verify) and the ratio columns."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def tiny_export(stories260k_dir, tmp_path):
    import jax.numpy as jnp
    from flax import nnx

    from dspark_jax.api import load_target
    from dspark_jax.config import DrafterConfig
    from dspark_jax.drafters.checkpoint import export_drafter
    from dspark_jax.drafters.dspark import DSparkDrafter

    os.environ.setdefault("DSPARK_MODELS", str(stories260k_dir.parent))
    target, _ = load_target("stories260k")
    cfg = DrafterConfig.for_target(
        target.cfg,
        block_size=2,
        num_layers=1,
        markov_rank=16,
        intermediate_size=32,
        target_fingerprint=target.fingerprint,
    )
    d = DSparkDrafter(cfg, nnx.Rngs(0))
    # confident enough on some positions that auto drafts and mixes widths
    rng = np.random.default_rng(0)
    w = d.conf_w[...]  # pyright: ignore[reportOptionalSubscript]
    d.conf_w[...] = jnp.asarray(rng.standard_normal(w.shape).astype(np.float32))  # pyright: ignore[reportOptionalSubscript]
    return export_drafter(d, tmp_path / "export")


@pytest.mark.slow
def test_speed_table_on_stories260k(stories260k_dir, tiny_export, tmp_path, capsys, monkeypatch):
    prompts = tmp_path / "short.jsonl"
    prompts.write_text(json.dumps({"prompt": "Once upon a time, there was a little cat."}) + "\n")
    out = tmp_path / "speed.json"
    argv = ["--target", "stories260k", "--drafter", tiny_export, "--prompts", f"tinystories,{prompts}"]
    argv += ["--num-prompts", "1", "--max-new-tokens", "8", "--temperatures", "0,1"]
    argv += ["--num-speculative-tokens", "auto", "--repeats", "2", "--cost-repeats", "1", "--no-hf"]
    # in process (the script's imports and the target's loading are a third of a subprocess run)
    monkeypatch.setenv("DSPARK_MODELS", str(stories260k_dir.parent))
    from benchmarks import speed_table

    assert speed_table.main([*map(str, argv), "--json", str(out)]) == 0
    stdout = capsys.readouterr().out
    r = json.loads(out.read_text())
    assert r["command"].startswith("python -m benchmarks.speed_table --target stories260k")
    assert list(r["tables"]) == ["T0", "T1"] and list(r["runs"]) == ["T0", "T1"]
    sets = ["tinystories", str(prompts)]
    assert list(r["prompt_sets"]) == sets and all(v["num_prompts"] == 1 for v in r["prompt_sets"].values())
    assert r["cost_tables"] and all(set(t["t_verify_ms"]) == {"0", "1", "2"} for t in r["cost_tables"].values())
    decoders = ["plain JAX", "drafter-auto"]
    for key in ("T0", "T1"):
        table = r["tables"][key]
        assert list(table["sets"]) == sets
        assert [m["decoder"] for m in table["macro"]] == decoders
        for s in sets:
            run = r["runs"][key][s]
            assert run["repeats"] == 2 and len(run["ar"]["tokens_per_s_runs"]) == 2
            rows = {row["decoder"]: row for row in table["sets"][s]}
            assert list(rows) == decoders and rows["plain JAX"]["speedup"] == 1.0
            d, row = run["drafters"]["drafter-auto"], rows["drafter-auto"]
            assert d["bound_from"] == "cost_table" and d["passes"] > 0
            assert d["tau"] == pytest.approx(d["emitted"] / d["passes"]) and 1.0 <= d["tau"] <= 3.0
            assert d["bound"] == pytest.approx(
                d["tau"] * d["t_target_step_ms"] / (d["t_draft_ms"] + d["t_verify_ms"]), rel=1e-6
            )
            # priced by the table at the widths auto chose (one prompt: one KV-cache length)
            (cache_len,) = d["cache_lens"]
            ct = r["cost_tables"][str(cache_len)]
            t_draft = ct["t_draft_ms"] if key == "T0" else ct["t_draft_sampled_ms"]
            per_pass = d["drafting_fraction"] * t_draft + sum(
                f * ct["t_verify_ms"][w] for w, f in d["width_mix"].items()
            )
            assert d["bound"] == pytest.approx(d["tau"] * ct["t_step_ms"] / per_pass, rel=1e-3)
            # the bound models the decode phase: compared with the speedup with the prefill subtracted
            assert d["bound_ratio_of"] == "decode_speedup" and d["prefill_ms"] > 0 and run["ar"]["prefill_ms"] > 0
            assert row["ratio"] == pytest.approx(row["decode_speedup"] / row["bound"])
            assert run["ar"]["decode_tokens_per_s"] > 0 and d["decode_tokens_per_s"] > 0
            assert set(d["width_mix"]) <= {"0", "1", "2"} and sum(d["width_mix"].values()) == pytest.approx(1.0)
            assert 0.0 <= d["drafting_fraction"] <= 1.0
            if key == "T0":
                assert d["same_as_ar"] == 1 and row["same_as_plain"] == "1/1"  # lossless
        assert set(table["checks"]) >= {"bound_ratio_min", "auto_macro_speedup", "auto_min_speedup"}
    assert "| macro | drafter-auto |" in stdout and "auto's bound prices each pass" in stdout
