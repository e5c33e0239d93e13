"""PNG plots of a sweep or comparison: latency vs QPS, throughput vs QPS and acceptance per
configuration, one line (or bar) per label so configurations sit side by side.

The x axis is the offered request rate; an unpaced run (QPS inf, paced only by its concurrency
cap) is placed at the rate it achieved.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and CI
import matplotlib.pyplot as plt
from matplotlib.axes import Axes

Run = dict[str, Any]


def offered_rate(run: Run) -> float:
    if run["request_rate"] == "inf":
        return run["request_throughput"]
    return float(run["request_rate"])


def _runs_by_label(runs: list[Run]) -> dict[str, list[Run]]:
    by_label: dict[str, list[Run]] = {}
    for run in runs:
        by_label.setdefault(str(run["label"]), []).append(run)
    return {label: sorted(group, key=offered_rate) for label, group in by_label.items()}


def _color(index: int) -> str:
    return f"C{index % 10}"


def draw_latency(ax: Axes, runs: list[Run], metric: str, title: str) -> None:
    """p50 (solid) and p99 (dashed) of one latency metric against the offered rate."""
    for index, (label, group) in enumerate(_runs_by_label(runs).items()):
        points = [(offered_rate(r), r[f"p50_{metric}_ms"], r[f"p99_{metric}_ms"]) for r in group
                  if r[f"p50_{metric}_ms"] is not None]
        if not points:
            continue
        rates, p50s, p99s = zip(*points)
        ax.plot(rates, p50s, "o-", color=_color(index), label=f"{label} p50")
        ax.plot(rates, p99s, "x--", color=_color(index), alpha=0.6, label=f"{label} p99")
    ax.set(title=title, xlabel="offered rate (req/s)", ylabel="ms")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def draw_throughput(ax: Axes, runs: list[Run]) -> None:
    """Output tokens per second against the offered rate."""
    for index, (label, group) in enumerate(_runs_by_label(runs).items()):
        ax.plot([offered_rate(r) for r in group], [r["output_throughput"] for r in group], "o-",
                color=_color(index), label=label)
    ax.set(title="Output throughput", xlabel="offered rate (req/s)", ylabel="tokens/s")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def draw_acceptance(ax: Axes, runs: list[Run]) -> None:
    """α per configuration over all its runs, τ written on each bar."""
    labels, rates, taus = [], [], []
    for label, group in _runs_by_label(runs).items():
        measured = [r for r in group if r["metrics_available"]]
        num_drafts = sum(r["num_drafts"] for r in measured)
        num_draft_tokens = sum(r["num_draft_tokens"] for r in measured)
        num_accepted = sum(r["num_accepted_tokens"] for r in measured)
        labels.append(label)
        rates.append(num_accepted / num_draft_tokens if num_draft_tokens else 0.0)
        taus.append(1.0 + num_accepted / num_drafts if num_drafts else None)
    bars = ax.bar(labels, rates, color=[_color(i) for i in range(len(labels))])
    for bar, tau in zip(bars, taus):
        text = "no drafts" if tau is None else f"τ {tau:.2f}"
        ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set(title="Acceptance per method", ylabel="acceptance rate α")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3, axis="y")


def write_plots(runs: list[Run], out_dir: str | Path) -> list[Path]:
    """latency.png, throughput.png, acceptance.png and all of them in summary.png."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []

    def save(figure: plt.Figure, name: str) -> None:
        figure.tight_layout()
        figure.savefig(out_dir / name, dpi=80)
        plt.close(figure)
        written.append(out_dir / name)

    figure, (ttft_ax, tpot_ax) = plt.subplots(1, 2, figsize=(9, 3.6))
    draw_latency(ttft_ax, runs, "ttft", "Time to first token")
    draw_latency(tpot_ax, runs, "tpot", "Time per output token")
    save(figure, "latency.png")

    figure, ax = plt.subplots(figsize=(4.5, 3.6))
    draw_throughput(ax, runs)
    save(figure, "throughput.png")

    figure, ax = plt.subplots(figsize=(4.5, 3.6))
    draw_acceptance(ax, runs)
    save(figure, "acceptance.png")

    figure, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    draw_latency(axes[0], runs, "ttft", "Time to first token")
    draw_latency(axes[1], runs, "tpot", "Time per output token")
    draw_throughput(axes[2], runs)
    draw_acceptance(axes[3], runs)
    save(figure, "summary.png")
    return written
