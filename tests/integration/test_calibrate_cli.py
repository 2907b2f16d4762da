"""``python -m dspark_jax.calibrate``: prompt selection, input errors, and a run on the quickly trained
stories260K export (a copy) that rewrites its temperatures from held-out prompts."""

from __future__ import annotations

import json
import shutil

import pytest

from dspark_jax.commands import calibrate


def test_select_prompts_takes_a_window_of_every_set_less_long_and_trained_prompts():
    sets = {"a": [[1], [2], [3, 3], [4], [5]], "b": [[6], [7, 7, 7], [8]]}
    ids, kept = calibrate.select_prompts(sets, skip=1, num=3, max_tokens=2, trained={(4,)})
    assert ids == [[2], [3, 3], [8]]  # a: [2], [3, 3], [4]-trained; b: [7, 7, 7] too long, [8]
    assert kept == {"a": 2, "b": 1}


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--num-prompts", "0"], "--num-prompts must be >= 1"),
        (["--skip", "-1"], "--skip must be >= 0"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(extra, message, tmp_path, capsys):
    rc = calibrate.main(["--target", "stories260k", "--drafter", str(tmp_path), "--prompts", "tinystories", *extra])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and err.count("\n") == 1


@pytest.mark.slow
def test_calibrates_a_copy_of_the_trained_export(stories260k_export, tmp_path, capsys):
    workdir, _ = stories260k_export
    export = tmp_path / "export"
    shutil.copytree(workdir / "export", export)
    before = json.loads((export / "drafter.json").read_text())
    report = tmp_path / "cal.json"
    argv = ["--target", "stories260k", "--drafter", str(export), "--prompts", "tinystories"]
    argv += ["--num-prompts", "12", "--max-new-tokens", "24", "--seq-len", "48", "--batch-size", "12"]
    argv += ["--exclude-data", str(workdir / "data"), "--report", str(report)]
    assert calibrate.main(argv) == 0
    line = json.loads(capsys.readouterr().out)
    after = json.loads((export / "drafter.json").read_text())
    # the first openings are training prompts of the quick run: the guard drops them
    assert 0 < line["prompts"]["tinystories"] < 12
    assert after["calibration"] == pytest.approx(line["temperatures"])
    assert after["calibration"] != before["calibration"]  # refit on other prompts and lengths
    assert after["calibration_greedy"] == pytest.approx(line["greedy"]["temperatures"])
    full = json.loads(report.read_text())
    assert full["heldout"]["num_prompts"] == line["prompts"]["tinystories"]
    assert full["after"]["pooled"]["ece"] == pytest.approx(line["after"]["ece"])
