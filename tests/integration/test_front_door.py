"""The decoding front door (issue 25): the Python API, ``python -m dspark_jax.generate``, the eval
command and ``serve/batch_generate.py`` resolve the same defaults and, for the same request, give
the same tokens, tau and acceptance.

stories260k with a tiny random DFlash drafter (block size 4: no confidence head, so the eval command
records no rounds and runs the very program the others compiled); one greedy request with every default
(``num_speculative_tokens`` ``"auto"``: the entry points run in this process and so share its
measured cost table, hence choose the same lengths) and one sampled request at a fixed
verification length, which also goes through ``python -m dspark_jax.generate`` in a subprocess.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.env import MODELS_DIR

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Once upon a time, there was a little"
MAX_NEW = 16
SAMPLED = dict(temperature=0.8, top_k=50, top_p=0.9, seed=3, num_speculative_tokens=3)
KEYS = ("token_ids", "tau", "acceptance_rate", "num_target_passes", "finish_reason")


@pytest.fixture(scope="module")
def setup(stories260k_dir, tmp_path_factory):
    """``(target, tokenizer, drafter, export dir)``: a random drafter exported and loaded back."""
    from flax import nnx

    from dspark_jax.api import load_target
    from dspark_jax.config import DrafterConfig
    from dspark_jax.decoding.request import load_drafter_for
    from dspark_jax.drafters.build import build_drafter
    from dspark_jax.drafters.checkpoint import export_drafter

    os.environ.setdefault("DSPARK_MODELS", str(MODELS_DIR))
    target, tok = load_target("stories260k")
    cfg = DrafterConfig.for_target(
        target.cfg,
        variant="dflash",
        block_size=4,
        num_layers=1,
        markov_rank=0,
        intermediate_size=24,
        target_fingerprint=target.fingerprint,
    )
    d = build_drafter(cfg, nnx.Rngs(0))
    export = tmp_path_factory.mktemp("front_door") / "export"
    export_drafter(d, export)
    drafter, _ = load_drafter_for(target, tok, str(export))
    return target, tok, drafter, export


def _flags(settings: dict) -> list[str]:
    return [f"--{k.replace('_', '-')}={v}" for k, v in settings.items()]


def _generate_cli(export, settings: dict, capsys) -> dict:
    from dspark_jax.commands.generate import main

    argv = ["--target", "stories260k", "--drafter", str(export), "--prompt", PROMPT, "--json"]
    assert main([*argv, f"--max-new-tokens={MAX_NEW}", *_flags(settings)]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _eval_cli(export, settings: dict, tmp_path, capsys) -> dict:
    """The eval command on the one prompt: its per-request record, in the API's terms."""
    from dspark_jax.commands.eval import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT}) + "\n")
    out = tmp_path / "eval"
    argv = ["--target", "stories260k", "--drafter", str(export), "--prompts", str(prompts), "--out", str(out)]
    assert main([*argv, f"--max-new-tokens={MAX_NEW}", *_flags(settings)]) == 0
    capsys.readouterr()
    ev = json.loads((out / "eval.json").read_text())
    assert ev["num_requests"] == 1
    return {
        "token_ids": ev["request_token_ids"][0],
        "tau": ev["request_tau"][0],
        "acceptance_rate": ev["request_acceptance_rate"][0],
        "num_target_passes": ev["request_target_passes"][0],
        "pooled": (ev["tau"], ev["acceptance_rate"]),
        "num_speculative_tokens": ev["num_speculative_tokens"],
    }


def _batch_script(export, settings: dict, tmp_path, capsys) -> dict:
    spec = importlib.util.spec_from_file_location("batch_generate", ROOT / "serve/batch_generate.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    line: dict = {"prompt": PROMPT, "max_tokens": MAX_NEW}
    line.update({k: v for k, v in settings.items() if k != "num_speculative_tokens"})
    src, dst = tmp_path / "requests.jsonl", tmp_path / "completions.jsonl"
    src.write_text(json.dumps(line) + "\n")
    flags = [f"--num-speculative-tokens={settings['num_speculative_tokens']}"] if settings else []
    argv = ["--target", "stories260k", "--drafter", str(export), "--input", str(src), "--output", str(dst)]
    assert mod.main(argv + flags) == 0
    capsys.readouterr()
    return json.loads(dst.read_text().strip())


def test_entry_points_resolve_the_same_defaults():
    from dspark_jax.api import generate_text
    from dspark_jax.commands.eval import build_parser as eval_parser
    from dspark_jax.commands.generate import build_parser as generate_parser
    from dspark_jax.decoding.request import DecodeRequest

    d = DecodeRequest.field_defaults()
    assert d["max_new_tokens"] == 128 and d["num_speculative_tokens"] == "auto" and d["seed"] == 0
    api = inspect.signature(generate_text).parameters
    for name in ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "num_speculative_tokens"):
        assert api[name].default == d[name], name
    need = ["--target", "t", "--drafter", "d"]
    gen = vars(generate_parser().parse_args([*need, "--prompt", "p"]))
    ev = vars(eval_parser().parse_args([*need, "--prompts", "x", "--out", "o"]))
    for name in ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "num_speculative_tokens"):
        assert gen[name] == ev[name] == d[name], name
    # one dtype policy (docs/design.md#numerics): auto everywhere, the server's included
    from dspark_jax.api import load_target
    from dspark_jax.commands.serve import build_parser as serve_parser

    assert gen["dtype"] == ev["dtype"] == serve_parser().get_default("dtype") == "auto"
    assert inspect.signature(load_target).parameters["dtype"].default == "auto"
    with pytest.raises(SystemExit):  # one spelling of the verification length: --gamma is gone
        eval_parser().parse_args([*need, "--prompts", "x", "--out", "o", "--gamma", "2"])


@pytest.mark.parametrize("settings", [{}, SAMPLED], ids=["greedy-defaults", "sampled"])
def test_api_cli_eval_and_batch_agree(setup, settings, tmp_path, capsys):
    from dspark_jax.api import generate_text

    target, tok, drafter, export = setup
    api = generate_text(target, tok, PROMPT, drafter=drafter, max_new_tokens=MAX_NEW, **settings)
    assert api["num_target_passes"] >= 1 and 1 <= len(api["token_ids"]) <= MAX_NEW
    want = {k: api[k] for k in KEYS}
    gen = _generate_cli(export, settings, capsys)
    assert {k: gen[k] for k in KEYS} == want and gen["text"] == api["text"]
    assert gen["num_speculative_tokens"] == settings.get("num_speculative_tokens", "auto")
    batch = _batch_script(export, settings, tmp_path, capsys)
    assert {k: batch[k] for k in KEYS} == want and batch["text"] == api["text"]
    ev = _eval_cli(export, settings, tmp_path, capsys)
    assert {k: ev[k] for k in KEYS if k != "finish_reason"} == {k: v for k, v in want.items() if k != "finish_reason"}
    tau, acc = ev["pooled"]  # the aggregate of one request is that request's (NaN/None: nothing verified)
    assert tau == api["tau"] and (
        acc == api["acceptance_rate"] or (api["acceptance_rate"] is None and (acc is None or acc != acc))
    )
    assert ev["num_speculative_tokens"] == gen["num_speculative_tokens"]
    if settings:  # the real command line too, in its own process
        cmd = [sys.executable, "-m", "dspark_jax.generate", "--target", "stories260k", "--drafter", str(export)]
        cmd += ["--prompt", PROMPT, f"--max-new-tokens={MAX_NEW}", *_flags(settings), "--json"]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=dict(os.environ))
        assert p.returncode == 0, p.stderr[-3000:]
        assert {k: json.loads(p.stdout)[k] for k in KEYS} == want
