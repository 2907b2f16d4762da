"""The serving engine's compiled programs are those of a base commit: ``benchmarks/engine_hlo.py``'s
fixed workload run on the working tree and on the base's ``dspark_jax/`` in this one environment
(same JAX, same XLA: a stored golden file would break at every JAX release, JAX not being pinned),
and the two sets of normalised module fingerprints compared.

The base commit (:func:`base_commit`):

* ``DSPARK_HLO_BASE`` (any git revision) when set: to check a refactor against where it started;
* else ``HEAD`` when ``dspark_jax/`` has uncommitted changes: the check a refactor runs before
  it is committed;
* else the parent of the last commit that changed ``dspark_jax/``: in CI, that commit left the
  engine's programs as they were. A commit that changes them on purpose says so with a line
  ``HLO-changed: <why>`` in its message, and the test then skips, naming it.

Every module must match, the decode steps', catch-up's, insert's and the row move's included,
except those of a program a declared change retired and of the program that replaced it
(``engine_hlo.RETIRED``: a base from before issue 25 compiles one-shot prefill as its own
``prefill_program``, the working tree as chunked prefill's ``one_shot_pass_program``), which are
listed (:func:`test_retired_programs_are_admitted_only_as_replaced` pins the rule).

Both sides run the working tree's script (by its path, so that ``PYTHONPATH`` alone chooses the
package: ``python -m`` would put the current folder first) in two processes at once, each with
XLA's backend optimisation turned down (the modules are hashed before optimisation). Skips
outside a git checkout, or where the base commit is not in the clone (a shallow one).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from benchmarks import engine_hlo

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "engine_hlo.py"
TRAILER = "HLO-changed:"


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=60)


def base_commit() -> tuple[str, str]:
    """``(commit, why it is the base)``; skips the test where there is none (see the module
    docstring for the choice)."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed: the base checkout cannot be made")
    top = _git("rev-parse", "--show-toplevel")
    if top.returncode or Path(top.stdout.strip()).resolve() != ROOT:
        pytest.skip(f"{ROOT} is not a git checkout (an sdist or a copy): no base commit to compare with")
    if ref := os.environ.get("DSPARK_HLO_BASE"):
        commit, why = ref, f"DSPARK_HLO_BASE={ref}"
    elif _git("status", "--porcelain", "--", "dspark_jax").stdout.strip():
        commit, why = "HEAD", "HEAD (dspark_jax/ has uncommitted changes)"
    else:
        last = _git("log", "-1", "--format=%H", "--", "dspark_jax").stdout.strip()
        message = _git("log", "-1", "--format=%B", last).stdout
        if declared := [ln for ln in message.splitlines() if ln.startswith(TRAILER)]:
            pytest.skip(f"{last[:10]}, the last commit that changed dspark_jax/, declares {declared[0]!r}")
        commit, why = f"{last}^", f"the parent of {last[:10]}, the last commit that changed dspark_jax/"
    resolved = _git("rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}")
    if resolved.returncode:
        pytest.skip(f"base commit {commit} ({why}) is not in this clone (a shallow one?)")
    return resolved.stdout.strip(), why


def _archive_package(commit: str, dest: Path) -> None:
    """``dspark_jax/`` of ``commit`` under ``dest`` (``git archive``: no worktree to clean up)."""
    p = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "dspark_jax"], capture_output=True, timeout=60)
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    with tarfile.open(fileobj=io.BytesIO(p.stdout)) as tar:
        if hasattr(tarfile, "data_filter"):  # Python >= 3.10.12 / 3.11.4: refuse paths outside dest
            tar.extractall(dest, filter="data")
        else:
            tar.extractall(dest)


def _start(package_root: Path, out: Path, cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(package_root), "DSPARK_CACHE_DIR": "off"}
    cmd = [sys.executable, str(SCRIPT), "--out", str(out)]
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def fingerprint_both(base_root: Path, tmp_path: Path) -> tuple[Path, Path]:
    """Runs the workload on ``base_root``'s package and on the working tree's, side by side;
    returns the two JSON files (base, working tree)."""
    outs = (tmp_path / "base.json", tmp_path / "tree.json")
    procs = [_start(root, out, tmp_path) for root, out in zip((base_root, ROOT), outs)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    for p, log, side in zip(procs, logs, ("base", "working tree")):
        assert p.returncode == 0, f"engine_hlo on the {side} failed:\n{log[-3000:]}"
    return outs


@pytest.mark.slow
def test_engine_programs_are_those_of_the_base_commit(tmp_path, capsys):
    commit, why = base_commit()
    base_root = tmp_path / "base"
    _archive_package(commit, base_root)
    base_json, tree_json = fingerprint_both(base_root, tmp_path)
    base, tree = (json.loads(p.read_text()) for p in (base_json, tree_json))
    # each side measured the package it was given (not the other through the current folder)
    assert Path(base["package"]) == (base_root / "dspark_jax").resolve()
    assert Path(tree["package"]) == (ROOT / "dspark_jax").resolve()
    assert tree["count"] > 20  # the workload compiled the engine's programs
    status = engine_hlo.compare(str(base_json), str(tree_json))
    report = capsys.readouterr().out
    assert status == 0, (
        f"the engine's compiled programs differ from {commit[:10]} ({why}); A = base, B = working tree.\n"
        f"{report}\nIf the change is intended, say so in the commit message ('{TRAILER} <why>') "
        "or compare against another base with DSPARK_HLO_BASE=<revision>."
    )


def _side(tmp_path, name: str, modules: dict[str, list[str]]) -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"count": len(modules), "hashes": sorted(modules), "modules": modules}))
    return str(path)


def test_retired_programs_are_admitted_only_as_replaced(tmp_path, capsys):
    """A base's one-shot prefill modules may be missing from a tree that compiles their
    replacement (and the replacement's modules new); any other difference, or the replacement
    changing between two bases that both have it, still fails; ``retired={}`` is strict."""
    step, old, new = ["jit_step_program"], ["jit_prefill_program"], ["jit_one_shot_pass_program"]
    base = _side(tmp_path, "base", {"s": step, "p16": old, "p32": old})
    tree = _side(tmp_path, "tree", {"s": step, "o16": new, "o32": new})
    assert engine_hlo.compare(base, tree) == 0
    assert "(retired: see RETIRED)" in capsys.readouterr().out
    assert engine_hlo.compare(base, tree, retired={}) == 1
    assert engine_hlo.compare(base, _side(tmp_path, "step", {"s2": step, "o16": new})) == 1
    assert engine_hlo.compare(tree, _side(tmp_path, "later", {"s": step, "o16x": new, "o32": new})) == 1
    assert engine_hlo.compare(base, _side(tmp_path, "gone", {"s": step})) == 1  # no replacement compiled
