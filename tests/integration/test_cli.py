"""Command-line behaviour: --help documents every flag; bad input exits 2 with one line; main job end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.env import MODELS_DIR

REPO = Path(__file__).resolve().parents[2]
SMOLLM2_CHATML = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


def cli(module: str, *args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e.setdefault("DSPARK_MODELS", str(MODELS_DIR))
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", f"dspark_jax.{module}", *args],
        capture_output=True,
        text=True,
        env=e,
        cwd=REPO,
        timeout=timeout,
    )


def assert_one_line_error(p: subprocess.CompletedProcess, *needles: str) -> None:
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    lines = [l for l in p.stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    for n in needles:
        assert n.lower() in lines[0].lower(), (n, lines[0])


@pytest.mark.parametrize("module", ["train", "generate"])
def test_help_documents_every_flag(module):
    import importlib

    mod = importlib.import_module(f"dspark_jax.{module}")
    parser = mod.build_parser()
    p = cli(module, "--help")
    assert p.returncode == 0, p.stderr
    for action in parser._actions:
        for opt in action.option_strings:
            assert opt in p.stdout, f"{opt} missing from --help"
        if action.option_strings and action.help is not None:
            assert action.help.strip(), f"{action.option_strings} has no help text"
    if module == "train":
        import dataclasses

        from dspark_jax.training.train_config import TrainConfig

        for f in dataclasses.fields(TrainConfig):  # a nested config's keys as drafter.block_size=...
            assert f"  {f.name}=" in p.stdout or f"  {f.name}." in p.stdout, f"config key {f.name} missing from --help"


def test_train_help_shows_the_default_presets_values():
    """train --help says its key=value defaults are the stories260k preset's: they are (steps, drafter.width)."""
    from dspark_jax.commands.train import build_parser
    from dspark_jax.training.recipes import DEFAULT_RECIPE, TRAIN_PRESETS

    epilog, preset = build_parser().epilog or "", TRAIN_PRESETS[DEFAULT_RECIPE]
    assert f"defaults shown for the {DEFAULT_RECIPE} preset" in epilog
    assert f"\n  steps={preset.steps!r}\n" in epilog
    assert f"\n  drafter.width={preset.drafter.width!r}  # or drafter_width=\n" in epilog


@pytest.mark.parametrize("module", ["train", "generate", "eval", "calibrate", "export", "serve"])
def test_help_names_every_flags_default(module):
    """Every option has help text, and one with a value default says "default" (e.g. serve's --log-level)."""
    import argparse
    import importlib

    parser = importlib.import_module(f"dspark_jax.{module}").build_parser()
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{module} {action.option_strings} has no help text"
        if action.nargs != 0 and action.default not in (None, argparse.SUPPRESS):
            assert "default" in action.help, f"{module} {action.option_strings}: default {action.default!r} not named"


def test_missing_model_files_is_one_line_error(tmp_path):
    p = cli("generate", "--target", "stories260k", "--prompt", "Once", env={"DSPARK_MODELS": str(tmp_path)})
    assert_one_line_error(p, "stories260k", "DSPARK_MODELS")
    p = cli("generate", "--target", str(tmp_path / "nope.gguf"), "--prompt", "Once")
    assert_one_line_error(p, "not an existing path")


def test_empty_prompt_is_one_line_error(stories260k_dir):
    assert_one_line_error(cli("generate", "--target", "stories260k", "--prompt", ""), "empty")


def test_prompt_longer_than_context_is_one_line_error(stories260k_dir):
    p = cli("generate", "--target", "stories260k", "--prompt", "the cat sat on the mat. " * 200)
    assert_one_line_error(p, "context")


def test_bad_train_override_is_one_line_error():
    assert_one_line_error(cli("train", "no_such_key=3"), "unknown config key")
    assert_one_line_error(cli("train", "steps=many"), "steps")


def test_drafter_for_another_target_is_refused(stories260k_dir, tmp_path):
    """A drafter exported for a different vocabulary (and one for different weights) is refused."""
    from flax import nnx

    from dspark_jax.config import DrafterConfig, TargetConfig
    from dspark_jax.drafters.checkpoint import export_drafter
    from dspark_jax.drafters.dspark import DSparkDrafter

    other = TargetConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_layers=5,
        num_heads=8,
        num_kv_heads=4,
        head_dim=8,
        max_position=512,
        name="other",
    )
    export_drafter(DSparkDrafter(DrafterConfig.for_target(other, block_size=4), nnx.Rngs(0)), tmp_path / "vocab")
    p = cli("generate", "--target", "stories260k", "--drafter", str(tmp_path / "vocab"), "--prompt", "Once")
    assert_one_line_error(p, "vocabulary")

    same_shape = TargetConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=172,
        num_layers=5,
        num_heads=8,
        num_kv_heads=4,
        head_dim=8,
        max_position=512,
        name="lookalike",
    )
    d = DSparkDrafter(
        DrafterConfig.for_target(same_shape, block_size=4, target_fingerprint="0123456789abcdef"), nnx.Rngs(0)
    )
    export_drafter(d, tmp_path / "weights")
    p = cli("generate", "--target", "stories260k", "--drafter", str(tmp_path / "weights"), "--prompt", "Once")
    assert_one_line_error(p, "trained for target")

    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "drafter.json").write_text("{not json")
    p = cli("generate", "--target", "stories260k", "--drafter", str(tmp_path / "broken"), "--prompt", "Once")
    assert_one_line_error(p, "corrupt")


@pytest.mark.slow
def test_smollm2_golden_chatml_through_generate():
    """README golden: the raw ChatML prompt answers 'The capital of France is Paris.' greedily."""
    p = cli(
        "generate",
        "--target",
        "smollm2-135m-instruct",
        "--prompt",
        SMOLLM2_CHATML,
        "--no-chat",
        "--max-new-tokens",
        "16",
        "--temperature",
        "0",
        "--json",
    )
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["text"] == "The capital of France is Paris."
    assert out["token_ids"][-1] == 2 and out["finish_reason"] == "stop"
    for key in ("text", "token_ids", "tau", "acceptance_rate", "num_target_passes", "tokens_per_s"):
        assert key in out


@pytest.mark.slow
def test_main_job_end_to_end(stories260k_export, tmp_path):
    """train (fixture) -> export -> generate --drafter --compare-ar --json: lossless and reported;
    a second process reuses the cost table the first measured (same lengths, so the same tau)."""
    workdir, summary = stories260k_export
    store = {"DSPARK_CACHE_DIR": str(tmp_path / "cache")}
    export = Path(summary["export_dir"])
    assert (export / "drafter.json").is_file() and (export / "params").is_dir()
    assert (Path(workdir) / "checkpoints").is_dir() and (Path(workdir) / "metrics.jsonl").is_file()
    ev = json.loads((Path(workdir) / "eval.json").read_text())
    assert ev["tau"] >= 1.0 and 0.0 <= ev["acceptance_rate"] <= 1.0
    p = cli(
        "generate",
        "--target",
        "stories260k",
        "--drafter",
        str(export),
        "--prompt",
        "Once upon a time",
        "--max-new-tokens",
        "48",
        "--temperature",
        "0",
        "--compare-ar",
        "--json",
        env=store,
    )
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    (stored,) = (tmp_path / "cache" / "costs").glob("cost_table-*.json")
    measured_at = stored.stat().st_mtime_ns
    again = cli("generate", *p.args[3:-2], "--json", env=store)  # the same request, without --compare-ar
    assert again.returncode == 0, again.stderr
    again_out = json.loads(again.stdout)
    assert stored.stat().st_mtime_ns == measured_at  # loaded, not measured again
    assert again_out["token_ids"] == out["token_ids"] and again_out["tau"] == out["tau"]
    for key in (
        "text",
        "token_ids",
        "tau",
        "acceptance_rate",
        "num_target_passes",
        "tokens_per_s",
        "ar_token_ids",
        "ar_tokens_per_s",
        "speedup",
    ):
        assert key in out, key
    assert out["token_ids"] == out["ar_token_ids"]
    # tau: tokens per verification pass, the prefill token excluded (decoding.results.Generation.tau)
    assert out["tau"] == pytest.approx((len(out["token_ids"]) - 1) / out["num_target_passes"])
    # sampled request through the same command
    p = cli(
        "generate",
        "--target",
        "stories260k",
        "--drafter",
        str(export),
        "--prompt",
        "The dog",
        "--max-new-tokens",
        "24",
        "--temperature",
        "0.8",
        "--top-k",
        "50",
        "--top-p",
        "0.9",
        "--num-speculative-tokens",
        "4",
        "--seed",
        "3",
        "--json",
    )
    assert p.returncode == 0, p.stderr
    assert 1 <= len(json.loads(p.stdout)["token_ids"]) <= 24


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--temperature", "nan"], "--temperature must be a finite number"),
        (["--temperature", "inf"], "--temperature must be a finite number"),
        (["--top-p", "nan"], "--top-p must be a finite number"),
        (["--temperature", "-0.5"], "--temperature must be >= 0"),
        (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
        # issue 27: numbers beyond what the device holds (int32 / float32 / int64 seeds)
        (["--top-k", "2147483648"], "--top-k must be an integer in [0, 2147483647] (0 is off), got 2147483648"),
        (["--temperature", "1e39"], "--temperature must be at most 3.402823e+38"),
        (["--max-new-tokens", "2147483648"], "--max-new-tokens must be at most 2147483647"),
        (["--max-new-tokens", str(2**70)], "--max-new-tokens must be at most 2147483647"),
        (["--seed", str(2**70)], "--seed must be an integer in"),
    ],
)
def test_nan_sampling_settings_are_one_line_errors(flags, needle, capsys):
    """Refused before any model is loaded (the target below does not exist)."""
    from dspark_jax.commands.generate import main

    assert main(["--target", "/nonexistent.gguf", "--prompt", "Once", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=float("nan")),
        dict(temperature=float("-inf")),
        dict(top_p=float("nan")),
        dict(top_k=float("nan")),
    ],
)
def test_python_api_refuses_nan_sampling_settings(kw):
    import numpy as np

    from dspark_jax.api import generate_text
    from dspark_jax.decoding.speculative import generate_autoregressive
    from dspark_jax.errors import DSparkInputError

    name = next(iter(kw))
    with pytest.raises(DSparkInputError, match=f"^{name} must be a finite number"):
        generate_text(None, None, "Once upon a time", **kw)  # refused before the model is touched
    with pytest.raises(DSparkInputError, match=name):
        generate_autoregressive(None, [[1, 2]], **{name: np.array([0.5, kw[name]])})


def test_temperature_whose_scaled_logits_overflow_is_greedy_in_api_and_cli(capsys):
    """Issue 27: T = 2e-38 (``logits / T`` overflows float32) used to decode token 0 four times
    with empty text; the API and ``generate`` now give the greedy tokens, and the API refuses
    a top_k beyond int32 in one line instead of an OverflowError."""
    from dspark_jax.api import generate_text, load_target
    from dspark_jax.commands.generate import main
    from dspark_jax.errors import DSparkInputError

    target, tok = load_target("stories260k")
    greedy = generate_text(target, tok, "Once upon a time", max_new_tokens=4)
    assert greedy["token_ids"] == [432, 383, 286, 261]
    tiny = generate_text(target, tok, "Once upon a time", max_new_tokens=4, temperature=2e-38)
    assert tiny["token_ids"] == greedy["token_ids"] and tiny["text"] == greedy["text"] != ""
    with pytest.raises(DSparkInputError, match=r"^top_k must be an integer in \[0, 2147483647\]"):
        generate_text(target, tok, "The cat", max_new_tokens=8, temperature=1.0, top_k=2**31)
    args = ["--target", "stories260k", "--prompt", "Once upon a time", "--max-new-tokens", "4", "--json"]
    assert main([*args, "--temperature", "2e-38"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == greedy["token_ids"]


def test_serve_cli_refuses_eagle3_drafter_in_one_line(stories260k, tmp_path, capsys):
    """The engine refuses an eagle3 drafter; `serve` turns it into one `error:` line, exit 2."""
    from flax import nnx

    from dspark_jax.commands.serve import main
    from dspark_jax.config import DrafterConfig
    from dspark_jax.drafters.build import build_drafter
    from dspark_jax.drafters.checkpoint import export_drafter
    from dspark_jax.drafters.eagle import eagle_taps
    from dspark_jax.models.weights import params_fingerprint

    cfg, params, _ = stories260k
    dcfg = DrafterConfig.for_target(
        cfg,
        variant="eagle3",
        num_layers=1,
        block_size=2,
        markov_rank=0,
        taps=eagle_taps(cfg),
        target_fingerprint=params_fingerprint(params),
    )
    export_drafter(build_drafter(dcfg, nnx.Rngs(0)), tmp_path / "eagle")
    assert (
        main(["--target", "stories260k", "--drafter", str(tmp_path / "eagle"), "--num-slots", "1", "--cache-len", "64"])
        == 2
    )
    err = [l for l in capsys.readouterr().err.strip().splitlines() if l.strip()]
    assert len(err) == 1 and err[0].startswith("error: ") and "eagle3" in err[0], err


def test_serve_cli_flags(capsys):
    from dspark_jax.commands.serve import build_parser, main

    args = build_parser().parse_args(["--target", "stories260k"])
    assert args.verification == "coupled" and args.api_key is None and args.default_max_tokens is None
    assert build_parser().parse_args(["--target", "x", "--verification", "rejection"]).verification == "rejection"
    assert main(["--target", "stories260k", "--api-key-health-metrics"]) == 2
    assert "needs --api-key" in capsys.readouterr().err
