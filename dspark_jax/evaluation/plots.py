"""The evaluation's plots: per-position acceptance and the reliability of the confidence head
during decoding, drawn from an eval.json dict (``python -m dspark_jax.eval`` writes both beside it).

Needs matplotlib (the ``plots`` extra), imported only when a plot is drawn.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["write_plots"]


def _f(x, spec: str = ".2f", scale: float = 1.0) -> str:
    return "n/a" if x is None else format(x * scale, spec)


def write_plots(ev: dict[str, Any], out_dir: Path) -> dict[str, str]:
    """Writes ``position_acceptance.png`` and ``reliability.png``; returns their paths.

    Args:
      ev: the eval.json dict of :func:`dspark_jax.commands.eval.run` (after
        :func:`~dspark_jax.evaluation.reliability.jsonable`).
      out_dir: an existing folder.
    Raises:
      ImportError: matplotlib is not installed (the ``plots`` extra).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = {
        "position_acceptance": str(out_dir / "position_acceptance.png"),
        "reliability": str(out_dir / "reliability.png"),
    }
    for name, plot in (("position_acceptance", _plot_position_acceptance), ("reliability", _plot_reliability)):
        fig = plot(plt, ev)
        fig.tight_layout()
        fig.savefig(paths[name])
        plt.close(fig)
    return paths


def _plot_position_acceptance(plt: Any, ev: dict[str, Any]) -> Any:
    """Figure: conditional acceptance c_k (bars) and accept rate @k (line) per block position."""
    pa = ev.get("position_acceptance") or []
    n_spec = ev.get("num_speculative_tokens")
    num_verified = n_spec if isinstance(n_spec, int) else len(pa)  # 'auto': every block position
    pa = pa[:num_verified]
    ks = list(range(1, len(pa) + 1))
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    ax.bar(
        ks, [v if v is not None else 0.0 for v in pa], color="#4C72B0", alpha=0.85, label="conditional acceptance c_k"
    )
    ar = ev.get("accept_rate_at_k") or []
    if ar:
        ax.plot(
            range(1, len(ar) + 1),
            [v if v is not None else float("nan") for v in ar],
            "o-",
            color="#DD8452",
            label="accept rate @k (rounds with >= k accepted)",
        )
    ax.set_xlabel("block position k")
    ax.set_ylabel("fraction")
    ax.set_ylim(0, 1.05)
    ax.set_xticks(ks)
    ax.set_title(
        f"{ev.get('target')} / {ev.get('variant')}: tau {_f(ev.get('tau'))}, "
        f"acceptance {_f(ev.get('acceptance_rate'))} ({ev['prompts']['set']})",
        fontsize=9,
    )
    ax.legend(fontsize=8, loc="lower left")
    ax.grid(alpha=0.3)
    return fig


def _plot_reliability(plt: Any, ev: dict[str, Any]) -> Any:
    """Figure: reliability diagram of the predicted cumulative survival during decoding (raw head
    and calibrated), with the per-bin counts below."""
    cal = ev.get("calibration") or {}
    dec = cal.get("decode") or {}
    fig, (ax, axh) = plt.subplots(2, 1, figsize=(5.6, 6.4), dpi=110, gridspec_kw={"height_ratios": [3, 1]}, sharex=True)
    ax.plot([0, 1], [0, 1], "--", color="gray", lw=1, label="perfect calibration")
    styles = {
        "before": ("#C44E52", "raw confidence head"),
        "after": ("#55A868", "calibrated (export temperatures and biases)"),
    }
    for name, (color, label) in styles.items():
        rep = dec.get(name)
        if not rep:
            continue
        rel = rep["reliability"]
        edges = rel["bin_edges"]
        width = edges[1] - edges[0]
        xs = [m for m, c in zip(rel["mean_predicted"], rel["count"]) if c]
        ys = [m for m, c in zip(rel["mean_observed"], rel["count"]) if c]
        pooled = rep["pooled"]
        ax.plot(
            xs,
            ys,
            "o-",
            color=color,
            ms=4,
            label=f"{label}: ECE {_f(pooled.get('ece'), '.1f', 100)}%, AUROC {_f(pooled.get('auroc'), '.3f')}, "
            f"Brier {_f(pooled.get('brier'), '.3f')}",
        )
        off = -width / 4 if name == "before" else width / 4
        axh.bar([e + width / 2 + off for e in edges[:-1]], rel["count"], width=width / 2, color=color, alpha=0.7)
    if not (dec.get("before") or dec.get("after")):
        ax.text(0.5, 0.5, "no confidence head / no verified rounds", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylabel("observed survival (positions 1..k accepted)")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_title(
        f"reliability of predicted cumulative survival during decoding\n"
        f"({dec.get('num_rounds', 0)} rounds, T={ev.get('temperature')}, {ev['prompts']['set']})",
        fontsize=9,
    )
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3)
    axh.set_xlabel("predicted survival a_k = prod c_i")
    axh.set_ylabel("count")
    axh.set_yscale("log")
    return fig
