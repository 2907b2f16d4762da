"""Tables and plots of :mod:`benchmarks.learning_curve`'s ``learning_curve.json``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.harness import cell


def _f(x, spec=".3f") -> str:
    return cell(x, spec, missing="n/a")


def _temps(state: dict[str, Any]) -> list[str]:
    return [f"T{t:g}" for t in state["settings"]["eval_temperatures"]]


def markdown(state: dict[str, Any]) -> str:
    """Per drafter and budget: steps, training seconds, params, tau +- SE and the doubling's gain +- paired
    SE per temperature, conditional acceptance per block position (pooled, first temperature)."""
    st = state["settings"]
    temps = _temps(state)
    data = state.get("data") or {}
    lines = [
        f"## Learning curves on {state.get('target')}",
        "",
        f"Identical data for every drafter ({data.get('sequences')} self-distilled sequences, "
        f"{data.get('generated_tokens')} target tokens); batch {st['batch_size']}, {st['anchors_per_seq']} anchor "
        f"blocks per sequence, block_size {st['block_size']}, lr {st['learning_rate']} warmup-stable-decay "
        f"(warmup {st['warmup_steps']} steps, linear decay over the last {st['decay_frac']:g} of each budget, "
        f"branched from one constant-rate trunk). Held-out prompts {st['eval_prompts']}, "
        f"{st['eval_max_new_tokens']} new tokens. Training seconds: training stage only (data generation, "
        f"feature cache and evaluation excluded). A drafter stops doubling at a plateau: a gain of at most "
        f"{state.get('noise_sigmas', 1):g} paired standard error(s) at every temperature.",
        "",
        "Commands: " + "; ".join(f"`{c}`" for c in state.get("commands", [])[-3:]),
        "",
        "| drafter | params | steps | train s | "
        + " | ".join(f"tau {t} | gain {t}" for t in temps)
        + f" | P(accept k) by position, {temps[0]} |",
        "|---|---|---|---|" + "---|---|" * len(temps) + "---|",
    ]
    for name, rec in state["drafters"].items():
        for p in rec["points"]:
            cells = []
            for t in temps:
                row = p["tau"][t]
                g = (p.get("gain") or {}).get(t)
                cells.append(f"{_f(row['macro_tau'])} +- {_f(row.get('macro_tau_stderr'))}")
                cells.append("-" if g is None else f"{g['delta']:+.3f} +- {_f(g['stderr'])}")
            pos = "/".join(_f(a, ".2f") for a in p["tau"][temps[0]]["position_acceptance_pooled"])
            lines.append(
                f"| {name} | {p['params']:,} | {p['steps']} | {_f(p['train_seconds'], '.0f')} | "
                + " | ".join(cells)
                + f" | {pos} |"
            )
        if rec.get("plateau_at") is not None:
            lines.append(f"| {name}: plateau at {rec['plateau_at']} steps | | | |" + " | |" * len(temps))
    lines.append("")
    return "\n".join(lines)


def plot_curves(state: dict[str, Any], out: Path) -> dict[str, str]:
    """``tau_vs_steps.png`` and ``tau_vs_seconds.png`` in ``out`` (one panel per temperature, error bars =
    standard error across prompts, log x axis); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = _temps(state)
    paths = {}
    for key, xlabel in (("steps", "training steps"), ("train_seconds", "training seconds (training stage)")):
        fig, axes = plt.subplots(1, len(temps), figsize=(5.2 * len(temps), 3.8), dpi=110, squeeze=False)
        for ax, t in zip(axes[0], temps):
            for name, rec in state["drafters"].items():
                pts = [p for p in rec["points"] if p.get(key) is not None]
                ax.errorbar(
                    [p[key] for p in pts],
                    [p["tau"][t]["macro_tau"] for p in pts],
                    yerr=[p["tau"][t].get("macro_tau_stderr") or 0.0 for p in pts],
                    fmt="o-",
                    ms=3,
                    capsize=2,
                    label=name,
                )
            if key == "steps":  # budgets double: one tick each
                ax.set_xscale("log", base=2)
                ticks = sorted({p["steps"] for rec in state["drafters"].values() for p in rec["points"]})
                ax.set_xticks(ticks, [str(x) for x in ticks])
            else:
                ax.set_xscale("log")
            ax.set_title(f"{state.get('target')}: held-out tau, {t.replace('T', 'temperature ')}", fontsize=9)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("tau (tokens per target pass)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / ("tau_vs_steps.png" if key == "steps" else "tau_vs_seconds.png")
        fig.savefig(path)
        plt.close(fig)
        paths[path.stem] = str(path)
    return paths
