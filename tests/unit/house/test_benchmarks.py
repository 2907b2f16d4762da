"""The benchmark suite's layout (``benchmarks/``, a package run as ``python -m benchmarks.<name>``):
no file edits ``sys.path``, the modules import each other without a cycle, nothing imports a
private name of the package or of another benchmark, every script runs as a module with its
usage line saying so; and the shared helpers of :mod:`benchmarks.harness`.

The layout checks read the source with :mod:`ast` (imports inside functions count); one fresh
interpreter then imports every module and asks every script for ``--help``.
"""

from __future__ import annotations

import ast
import graphlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import harness

ROOT = Path(__file__).resolve().parents[3]
BENCH = ROOT / "benchmarks"
FILES = sorted(BENCH.rglob("*.py"))


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in FILES}
TREES = {m: ast.parse(p.read_text(), str(p)) for m, p in MODULES.items()}
SCRIPTS = sorted(
    m for m, t in TREES.items() if any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in t.body)
)


def _imported(mod: str, node: ast.AST) -> list[tuple[str, list[str]]]:
    """``(module, names)`` an import statement names (relative imports resolved)."""
    if isinstance(node, ast.Import):
        return [(a.name, []) for a in node.names]
    if isinstance(node, ast.ImportFrom):
        base = mod.split(".") if MODULES[mod].name == "__init__.py" else mod.split(".")[:-1]
        src = node.module or ""
        if node.level:
            src = ".".join(base[: len(base) - node.level + 1] + ([src] if src else []))
        return [(src, [a.name for a in node.names])]
    return []


def graph() -> dict[str, set[str]]:
    """Benchmark module -> the benchmark modules it imports, anywhere in its source."""
    out: dict[str, set[str]] = {m: set() for m in MODULES}
    for mod, tree in TREES.items():
        for node in ast.walk(tree):
            for src, names in _imported(mod, node):
                targets = [f"{src}.{n}" for n in names if f"{src}.{n}" in MODULES] or [src]
                out[mod] |= {t for t in targets if t in MODULES and t != mod}
    return out


def test_the_suite_is_a_package_and_the_walk_sees_it():
    assert (BENCH / "__init__.py").is_file()
    assert {"benchmarks.harness", "benchmarks.serve_load", "benchmarks.prefill_load"} <= set(MODULES)
    g = graph()
    assert "benchmarks.http_load" in g["benchmarks.prefill_load"] and "benchmarks.harness" in g["benchmarks.speedup"]


def test_no_file_edits_sys_path():
    """Not even a read: ``sys.path`` is not named in ``benchmarks/`` (nor ``site.addsitedir``)."""
    problems = [
        f"{MODULES[m].relative_to(ROOT)}:{n.lineno}"
        for m, t in TREES.items()
        for n in ast.walk(t)
        if isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Name)
        and (n.value.id, n.attr) in {("sys", "path"), ("site", "addsitedir")}
    ]
    assert not problems, "sys.path named in:\n  " + "\n  ".join(problems)


def test_no_import_cycle():
    try:
        graphlib.TopologicalSorter(graph()).prepare()
    except graphlib.CycleError as e:
        pytest.fail(f"import cycle between benchmark modules: {' -> '.join(e.args[1])}")


def test_the_cycle_check_sees_a_cycle():
    with pytest.raises(graphlib.CycleError):
        graphlib.TopologicalSorter({"a": {"b"}, "b": {"a"}}).prepare()


def test_no_private_name_is_imported():
    """``from dspark_jax.x import _y`` / ``from benchmarks.x import _y``: use or make public API."""
    problems = [
        f"{MODULES[m].relative_to(ROOT)}:{n.lineno}: {src}.{name}"
        for m, t in TREES.items()
        for n in ast.walk(t)
        if isinstance(n, (ast.Import, ast.ImportFrom))
        for src, names in _imported(m, n)
        for name in names
        if src.split(".")[0] in ("dspark_jax", "benchmarks") and name.startswith("_")
    ]
    problems += [
        f"{MODULES[m].relative_to(ROOT)}:{n.lineno}: {a.name}"
        for m, t in TREES.items()
        for n in ast.walk(t)
        if isinstance(n, ast.Import)
        for a in n.names
        if any(part.startswith("_") for part in a.name.split(".")[1:]) and a.name.split(".")[0] == "dspark_jax"
    ]
    assert not problems, "private names imported:\n  " + "\n  ".join(problems)


def test_every_script_has_a_main_guard():
    def guarded(tree: ast.Module) -> bool:
        return any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body)

    assert len(SCRIPTS) >= 15
    assert not [m for m in SCRIPTS if not guarded(TREES[m])]


_HELP = """
import contextlib, io, json, runpy, sys
out = {}
for name in NAMES:
    sys.argv = [name, "--help"]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
        runpy.run_module(name, run_name="__main__", alter_sys=True)
    out[name] = buf.getvalue()
print("HELP" + json.dumps(out))
"""


@pytest.mark.slow
def test_every_module_imports_and_every_script_runs_as_a_module():
    """In one fresh interpreter from the repository root (as ``python -m`` runs them): every module
    imports, and every script's ``--help`` names its ``python -m benchmarks.<name>`` command."""
    code = f"import importlib\nfor m in {sorted(MODULES)!r}:\n    importlib.import_module(m)\n"
    code += f"NAMES = {SCRIPTS!r}\n" + _HELP
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    helps = json.loads(p.stdout.rpartition("HELP")[2])
    bad = {m: h[:200] for m, h in helps.items() if not h.startswith(f"usage: python -m {m}")}
    assert not bad, bad


# ----------------------------------------------------------------------------- harness


def test_alternate_reverses_the_order_every_round_and_skips_the_warmup():
    calls: list[str] = []
    secs = {"a": iter([9.0, 1.0, 2.0, 3.0]), "b": iter([9.0, 5.0, 7.0, 6.0])}

    def case(k):
        def run():
            calls.append(k)
            return next(secs[k])

        return run

    med = harness.alternate({"a": case("a"), "b": case("b")}, reps=3, warmup=1)
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert med == {"a": 2.0, "b": 6.0}  # the warm-up's 9.0 not counted


def test_cells_tables_ratios_and_the_recorded_command():
    assert harness.cell(None) == "-" and harness.cell(1.23456, ".2f") == "1.23" and harness.cell("x") == "x"
    assert harness.ratio(3.0, 2.0) == 1.5 and harness.ratio(None, 2.0) is None and harness.ratio(1.0, 0.0) is None
    assert harness.markdown_table([{"n": 1, "ms": 0.5, "name": "a", "x": None}]) == (
        "| n | ms | name | x |\n| --- | --- | --- | --- |\n| 1 | 0.500 | a | - |"
    )
    assert (
        harness.command_line("speed_table", ["--prompts", "a b"]) == "python -m benchmarks.speed_table --prompts 'a b'"
    )


def test_policy_arms_split_their_ahead_suffix():
    from dspark_jax.errors import DSparkInputError

    split_ahead = harness.split_ahead
    assert split_ahead("fixed:8+ahead") == ("fixed:8", True) and split_ahead("dspark") == ("dspark", False)
    with pytest.raises(DSparkInputError, match=r"\+ahead"):
        split_ahead("fixed:8+later")


def test_write_json_converts_numpy_and_creates_the_folder(tmp_path):
    import numpy as np

    path = harness.write_json(tmp_path / "sub" / "r.json", {"a": np.float32(0.5), "b": np.arange(2), "p": tmp_path})
    assert json.loads(path.read_text()) == {"a": 0.5, "b": [0, 1], "p": str(tmp_path)}
    with pytest.raises(TypeError):
        harness.write_json(tmp_path / "bad.json", {"s": {1, 2}})


def test_load_checkout_imports_the_other_package_inside_its_own_tree(tmp_path):
    """A fake checkout whose submodule imports its own package absolutely: it resolves there, and
    this process's ``dspark_jax`` modules are back afterwards."""
    pkg = tmp_path / "old" / "dspark_jax"
    (pkg / "serving").mkdir(parents=True)
    (pkg / "__init__.py").write_text("ORIGIN = 'old'\n")
    (pkg / "config.py").write_text("VALUE = 41\n")
    (pkg / "serving" / "__init__.py").write_text("")
    (pkg / "serving" / "engine.py").write_text("from dspark_jax.config import VALUE\nfrom dspark_jax import ORIGIN\n")
    import dspark_jax

    before = {k: v for k, v in sys.modules.items() if k == "dspark_jax" or k.startswith("dspark_jax.")}
    mods = harness.load_checkout(tmp_path / "old", ["serving.engine"])
    assert mods["serving.engine"].VALUE == 41 and mods["serving.engine"].ORIGIN == "old"
    assert Path(mods["serving.engine"].__file__ or "").is_relative_to(tmp_path)
    assert sys.modules["dspark_jax"] is dspark_jax
    assert {k: v for k, v in sys.modules.items() if k == "dspark_jax" or k.startswith("dspark_jax.")} == before
    with pytest.raises(FileNotFoundError):
        harness.load_checkout(tmp_path, ["config"])


def test_speed_table_rejects_a_length_its_bound_cannot_price_before_running():
    from benchmarks import speed_table

    parser = speed_table.build_parser()
    speed_table.check_lengths(parser, "1,2,4,8,auto", 8)  # the compiled widths pass
    for bad in ("3", "2,9", "x"):
        with pytest.raises(SystemExit) as e:
            speed_table.check_lengths(parser, bad, 8)
        assert e.value.code == 2


def _parser_dests(tree: ast.AST) -> set[str]:
    """Each ``add_argument`` call's dest: ``dest=`` or its first long option, dashes as underscores."""
    dests = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            explicit = [k.value.value for k in node.keywords if k.arg == "dest" and isinstance(k.value, ast.Constant)]
            flags = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            longs = [f for f in flags if f.startswith("--")] or flags
            if explicit or longs:
                dests.add(str(explicit[0] if explicit else longs[0].lstrip("-").replace("-", "_")))
    return dests


def _namespace_functions(tree: ast.AST) -> list[ast.FunctionDef]:
    """Functions whose ``args`` is the parsed namespace: a parameter, or bound from ``parse_args``."""
    out = []
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef):
            continue
        parsed = any(
            isinstance(n, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "args" for t in n.targets)
            and isinstance(n.value, ast.Call)
            and getattr(n.value.func, "attr", "") in {"parse_args", "parse_known_args"}
            for n in ast.walk(fn)
        )
        if parsed or "args" in {a.arg for a in fn.args.args + fn.args.kwonlyargs}:
            out.append(fn)
    return out


def test_every_args_attribute_a_script_reads_is_a_flag_it_defines():
    """``args.NAME`` read in a script is one of its parser's dests or set by the script itself (a renamed
    flag whose old name is still read fails only on the path that reads it, which a test may miss).
    A script's known dests include those of the benchmark modules it imports (shared flag groups)."""
    missing, imports = {}, graph()
    for mod in SCRIPTS:
        tree = TREES[mod]
        known = _parser_dests(tree).union(*(_parser_dests(TREES[m]) for m in imports[mod]))
        reads, sets = set(), set()
        for fn in _namespace_functions(tree):
            for node in ast.walk(fn):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "args":
                    (sets if isinstance(node.ctx, ast.Store) else reads).add(node.attr)
        if unknown := sorted(reads - known - sets):
            missing[mod] = unknown
    assert not missing, missing


def test_llama_cpp_rounds_align_by_start_position_and_count_acceptance_per_position():
    from benchmarks import llama_cpp as lc

    # ours: prefill emits token 0, rounds from position 1; llama.cpp's speculative-simple starts a
    # round at 0 (drafting at the prompt's last token) and may run one round past n = 12
    ours = lc.starts([(2, 4), (0, 4), (4, 4), (1, 2)], 1, 12)
    theirs = lc.starts([(1, 4), (2, 4), (0, 4), (3, 4), (1, 2), (4, 4)], 0, 12)
    assert ours == {1: (2, 4), 4: (0, 4), 5: (4, 4), 10: (1, 2)}
    assert theirs == {2: (2, 4), 5: (0, 4), 6: (3, 4), 10: (1, 2)}
    assert lc.align(ours, theirs) == (2, 1)  # positions 5 and 10 in both; 10 accepts the same
    # conditional: position k counts the rounds that verified k with 1..k-1 accepted
    assert lc.position_acceptance([(0, 4), (2, 4), (4, 4), (1, 1)], 4) == [3 / 4, 2 / 2, 1 / 2, 1 / 1]
    assert lc.position_acceptance([(0, 2)], 3) == [0.0, None, None]


def test_llama_cpp_speed_reads_llama_cpp_logs_and_counts_agreeing_tokens():
    from benchmarks import llama_cpp_speed as ls
    from benchmarks.llama_cpp import llama_seconds

    completion = (  # llama-completion's perf lines: 10 eval runs = 11 sampled tokens (the EOS not evaluated)
        "common_perf_print:    sampling time =       0.91 ms\n"
        "common_perf_print: prompt eval time =      80.42 ms /    17 tokens (    4.73 ms per token)\n"
        "common_perf_print:        eval time =     218.97 ms /    10 runs   (   21.90 ms per token)\n"
    )
    n, s = llama_seconds(completion, speculative=False) or (0, 0.0)
    assert n == 11 and abs(s - 0.3003) < 1e-9
    spec = "encoded   17 tokens in    0.145 seconds, speed: 117.2 t/s\n"
    spec += "decoded   11 tokens in    1.672 seconds, speed: 6.5 t/s"
    n, s = llama_seconds(spec, speculative=True) or (0, 0.0)
    assert n == 11 and abs(s - 1.817) < 1e-9
    assert llama_seconds(spec, speculative=False) is None and llama_seconds(completion, speculative=True) is None
    log = "prompt: 'x'\nnumber of tokens in prompt = 3\n0.00.1 I      1 -> '<|im_start|>'\n0.00.2 I    198 -> '\n'\n"
    log += "0.00.3 I   4093 -> 'user'\nsampler seed: 42 -> '?'\n"
    assert ls.prompt_token_ids(log) == [1, 198, 4093] and ls.prompt_token_ids("no prompt") == []
    pieces = {1: "a", 2: "b", 3: "\u00e9"}
    decode = lambda ids: "".join(pieces[i] for i in ids)
    assert ls.agreeing_tokens(decode, [1, 2, 1, 3], "abaX") == 3 and ls.agreeing_tokens(decode, [2], "abc") == 0
    assert ls.agreeing_tokens(decode, [1, 2], "ab [end]") == 2
    runs = [{"tokens": 10, "seconds": 1.0}, {"tokens": 30, "seconds": 1.0}, {"error": "e"}]
    assert ls.medians({"x": runs}) == {"x": 20.0}
    assert ls.acceptance([{"drafted": 7, "accepted": 3}, {"drafted": 7, "accepted": 4}, {}]) == 0.5
    assert ls.acceptance([{}]) is None


def test_sentencepiece_model_is_the_protobuf_of_the_vocabulary():
    from benchmarks.llama_cpp_files import sentencepiece_model

    pieces = [b"<unk>", b"\n<s>\n", b"\n</s>\n", *(b"<0x%02X>" % i for i in range(256)), b" the"]
    proto = sentencepiece_model(pieces, [0.0] * 259 + [-1.5])
    assert b"\x0a\x05<unk>" in proto and "\u2581the".encode() in proto and b"<0x0A>" in proto
    try:  # the test extra installs it: in CI a missing sentencepiece fails, it never skips
        import sentencepiece as sp
    except ImportError:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            raise
        pytest.skip("sentencepiece is not installed (the test extra pins it)")
    m = sp.SentencePieceProcessor(model_proto=proto)
    assert m.vocab_size() == 260 and m.id_to_piece(259) == "\u2581the" and m.get_score(259) == -1.5
    assert m.is_control(1) and m.is_byte(3) and m.bos_id() == 1 and m.eos_id() == 2
    assert m.encode("\u00e9", add_bos=True) == [1, 3 + 0xE2, 3 + 0x96, 3 + 0x81, 3 + 0xC3, 3 + 0xA9]  # byte fallback


def test_h100_topology_without_the_cuda_plugin_is_a_value_error():
    """Without jax_plugins (no CUDA plugin), the check says False and h100:<n> is refused by name, not with
    ModuleNotFoundError (which also broke test_gpu_compile.py's collection)."""
    from benchmarks import tpu_compile

    if tpu_compile.cuda_plugin_installed():
        pytest.skip("jax-cuda12-plugin installed")
    with pytest.raises(ValueError, match="needs jax-cuda12-plugin"):
        tpu_compile.gpu_devices("h100:4")
