"""``python -m dspark_jax.eval``: flags, prompt sets, input errors, and end-to-end runs on
stories260K that write eval.json and both plots."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from dspark_jax.commands import eval as eval_cli
from dspark_jax.data.prompts import PROMPT_SETS, load_prompt_texts
from dspark_jax.drafters.checkpoint import FORMAT
from tests.helpers.env import MODELS_DIR

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _main(argv, capsys):
    rc = eval_cli.main([str(a) for a in argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit) as e:
        eval_cli.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for action in eval_cli.build_parser()._actions:
        assert action.help, f"{action.dest} has no help"
        for opt in action.option_strings:
            assert opt in text
    for name in PROMPT_SETS:
        assert name in text


@pytest.fixture
def fake_export(tmp_path):
    """A directory that passes the export-format check (enough for errors raised before loading)."""
    d = tmp_path / "export"
    d.mkdir()
    (d / "drafter.json").write_text(json.dumps({"format": FORMAT, "config": {}}))
    return d


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--num-prompts", "0"], "--num-prompts must be >= 1"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--temperature", "-1"], "--temperature must be >= 0"),
        (["--temperature", "nan"], "--temperature must be a finite number"),
        (["--top-p", "inf"], "--top-p must be a finite number"),
        (["--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--top-k", "2147483648"], "--top-k must be an integer in [0, 2147483647]"),
        (["--max-new-tokens", "2147483648"], "--max-new-tokens must be at most 2147483647"),
        (["--batch-size", "0"], "--batch-size must be >= 1"),
        (["--prompts", "no_such_set"], "neither a prompt set"),
        (["--drafter", "/nonexistent/export"], "not a drafter export"),
    ],
)
def test_bad_input_is_one_error_line_and_exit_2(extra, message, fake_export, tmp_path, capsys):
    argv = ["--target", "stories260k", "--drafter", fake_export, "--prompts", "tinystories", "--out", tmp_path / "out"]
    for i in range(0, len(extra), 2):  # later flags win in argparse
        argv += extra[i : i + 2]
    rc, out, err = _main(argv, capsys)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]
    assert not (tmp_path / "out").exists()


def test_bad_prompt_file_is_an_error(fake_export, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{not json\n')
    rc, _, err = _main(
        ["--target", "stories260k", "--drafter", fake_export, "--prompts", bad, "--out", tmp_path / "o"], capsys
    )
    assert rc == 2 and err.startswith("error: ") and "bad.jsonl:2" in err


def test_prompt_sets_load():
    from dspark_jax.data.prompts import shared_data_dir, split_prompts, tinystories_openings
    from dspark_jax.errors import DSparkInputError

    try:
        shared_data_dir()
    except DSparkInputError:
        from tests.helpers.env import require

        require(None, "shared data (prompt sets)", "set DSPARK_DATA=/path/to/shared/data")
    sets = {name: load_prompt_texts(name)[0] for name in PROMPT_SETS}
    for name, texts in sets.items():
        assert texts and all(isinstance(t, str) and t for t in texts), name
    assert sets["mt_bench"][0].startswith("Compose an engaging travel blog post")  # first turn only
    assert len(sets["mt_bench"]) == 80 and len(sets["alpaca"]) == 80 and len(sets["humaneval"]) == 164
    assert sets["gsm8k"][0].startswith("Janet")
    assert sets["humaneval"][0].startswith("from typing import List")
    # tinystories: the held-out split of the drafter's training run when the export records one
    meta = {"extra": {"config": {"prompts": "tinystories", "prompts_file": "", "num_eval_prompts": 7, "seed": 3}}}
    held, source = load_prompt_texts("tinystories", meta)
    assert held == split_prompts(tinystories_openings(), 7, 3)[1] and "held-out" in source


def _check_outputs(out_dir, block_size, calibrated):
    ev = json.loads((out_dir / "eval.json").read_text())
    for png in ("position_acceptance.png", "reliability.png"):
        data = (out_dir / png).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 2000, png
    # `auto` may verify no draft of a random drafter at all (its measured costs decide): then
    # there is no acceptance rate (null) and every pass emitted exactly one token
    rate = ev["acceptance_rate"]
    assert ev["tau"] == 1.0 if rate is None else ev["tau"] >= 1.0 and 0.0 <= rate <= 1.0
    ar = ev["accept_rate_at_k"]
    assert len(ar) == block_size and all(a >= b for a, b in zip(ar, ar[1:]))
    # A round may verify nothing (at the length limit, or `auto` finding no draft worth its cost):
    # position 1 then may never have been verified at all.
    pa0 = ev["position_acceptance"][0]
    assert ar[0] == 0.0 if pa0 is None else ar[0] <= pa0 + 1e-9
    assert ev["tau"] <= 1 + sum(ar) + 1e-9  # equality without stop tokens
    cal = ev["calibration"]
    dec = cal["decode"]
    assert dec["num_rounds"] == ev["num_target_passes"]
    assert {"ece", "auroc", "brier", "n"} <= set(dec["before"]["pooled"])
    assert len(dec["before"]["per_position"]) == block_size
    assert ("after" in dec) == calibrated and (cal["temperatures"] is not None) == calibrated
    return ev


def test_eval_cli_random_drafter_on_stories260k(stories260k_dir, tmp_path, capsys):
    """A tiny random DSpark drafter (calibrated by hand) through the whole command."""
    import jax.numpy as jnp
    from flax import nnx

    from dspark_jax.api import load_target
    from dspark_jax.config import DrafterConfig
    from dspark_jax.drafters.checkpoint import export_drafter
    from dspark_jax.drafters.dspark import DSparkDrafter

    os.environ.setdefault("DSPARK_MODELS", str(MODELS_DIR))
    target, _ = load_target("stories260k")
    cfg = DrafterConfig.for_target(
        target.cfg,
        block_size=4,
        num_layers=1,
        markov_rank=16,
        intermediate_size=32,
        target_fingerprint=target.fingerprint,
    )
    d = DSparkDrafter(cfg, nnx.Rngs(0))
    d.conf_w[...] = jnp.asarray(np.random.default_rng(0).standard_normal(d.conf_w[...].shape).astype(np.float32))
    d.set_calibration([2.0, 1.0, 0.5, 1.5])
    export_drafter(d, tmp_path / "export")
    out = tmp_path / "eval"
    rc, stdout, err = _main(
        [
            "--target",
            "stories260k",
            "--drafter",
            tmp_path / "export",
            "--prompts",
            "tinystories",
            "--num-prompts",
            3,
            "--max-new-tokens",
            12,
            "--batch-size",
            4,
            # a fixed length: `auto` (the default, test_front_door's) may verify no draft of a random
            # drafter at all, depending on the measured costs, and leave nothing to calibrate
            "--num-speculative-tokens",
            4,
            "--out",
            out,
        ],
        capsys,
    )
    assert rc == 0, err
    assert json.loads(stdout.strip().splitlines()[-1])["out"] == str(out.resolve())
    ev = _check_outputs(out, 4, calibrated=True)
    assert ev["calibration"]["temperatures"] == [2.0, 1.0, 0.5, 1.5]
    assert ev["prompts"]["num_prompts"] == 3 and ev["block_size"] == 4
    assert ev["num_speculative_tokens"] == 4 and ev["acceptance_rate"] is not None
    rc, _, err = _main(
        [
            "--target",
            "stories260k",
            "--drafter",
            tmp_path / "export",
            "--prompts",
            "tinystories",
            "--num-speculative-tokens",
            9,
            "--out",
            tmp_path / "e2",
        ],
        capsys,
    )
    assert rc == 2 and "num_speculative_tokens must be in [1, 4]" in err


@pytest.mark.slow
def test_eval_cli_on_trained_export(stories260k_export, tmp_path, capsys):
    """The quickly trained drafter of the train command: calibration stored by training, used by eval."""
    workdir, summary = stories260k_export
    cal = summary["calibration"]
    meta = json.loads((workdir / "export/drafter.json").read_text())
    block_size = meta["config"]["block_size"]
    assert meta["calibration"] == pytest.approx(cal["temperatures"]) and len(cal["temperatures"]) == block_size
    full = json.loads((workdir / "calibration.json").read_text())
    assert full["after"]["pooled"]["ece"] == pytest.approx(cal["after"]["ece"])
    assert json.loads((workdir / "summary.json").read_text())["calibration"]["temperatures"] == cal["temperatures"]
    out = tmp_path / "eval"
    rc, _, err = _main(
        [
            "--target",
            "stories260k",
            "--drafter",
            workdir / "export",
            "--prompts",
            "tinystories",
            "--num-prompts",
            4,
            "--max-new-tokens",
            32,
            # a fixed length, as above: `auto` may verify no draft of a 40-step drafter on a busy
            # machine (its measured costs decide), and leave nothing to calibrate (CI, session 16)
            "--num-speculative-tokens",
            block_size,
            "--out",
            out,
        ],
        capsys,
    )
    assert rc == 0, err
    ev = _check_outputs(out, block_size, calibrated=True)
    assert "held-out" in ev["prompts"]["source"]
    assert ev["calibration"]["heldout_fit"]["after"]["ece"] == pytest.approx(cal["after"]["ece"])
