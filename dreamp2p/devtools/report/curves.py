"""The run's curves: training and eval loss over time per node, and each link's measured goodput and RTT."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

from dreamp2p.devtools.report.draw import SIZE, agg_figure, no_data, node_colors, png_path, save_png, utc_label
from dreamp2p.devtools.report.runlog import LINK_PNG, LOSS_PNG, NodeLog
from dreamp2p.devtools.report.summary import SMOOTH_WINDOW, run_start, running_mean


def plot_loss(logs: Mapping[str, NodeLog], out: Path) -> Path:
    """``loss_vs_time.png``: training loss (running mean, raw faintly behind) and eval loss (markers) per node.

    x is wall-clock seconds since the run's first record (any node, any kind); one colour per node.
    """
    path = png_path(out, LOSS_PNG)
    t0 = run_start(logs)
    with agg_figure(SIZE) as fig:
        ax = fig.add_subplot()
        lows: list[float] = []
        highs: list[float] = []
        for color, (node_id, node) in zip(node_colors(len(logs)), logs.items(), strict=True):
            pts = [(r["t"] - t0, r["loss"]) for r in node.steps if math.isfinite(r["loss"])]
            if pts:
                xs = [p[0] for p in pts]
                ys = [p[1] for p in pts]
                smooth = running_mean(ys)
                ax.plot(xs, ys, color=color, lw=0.6, alpha=0.18, zorder=1)
                label = f"{node_id} train (mean of {SMOOTH_WINDOW})" if len(ys) > 1 else f"{node_id} train"
                ax.plot(xs, smooth, color=color, lw=1.4, label=label, zorder=2)
                lows.append(min(smooth))
                highs.append(max(smooth))
            evs = [(r["t"] - t0, r["eval_loss"]) for r in node.evals if math.isfinite(r["eval_loss"])]
            if evs:
                ex = [p[0] for p in evs]
                ey = [p[1] for p in evs]
                ax.plot(ex, ey, color=color, ls="--", lw=0.8, marker="o", ms=5, mec="white", mew=0.8, zorder=3)
                ax.plot([], [], color=color, ls="none", marker="o", ms=5, mec="white", label=f"{node_id} eval")
                lows.append(min(ey))
                highs.append(max(ey))
        if lows:
            lo, hi = min(lows), max(highs)
            pad = 0.06 * (hi - lo) if hi > lo else max(0.05, 0.05 * abs(hi))
            ax.set_ylim(lo - pad, hi + pad)  # the raw losses are context: their spikes may leave the frame
            ax.legend(loc="upper right", ncols=2 if len(logs) > 4 else 1, framealpha=0.9)
        else:
            no_data(ax, "no loss records yet")
        ax.set_xlabel("wall-clock time (s)")
        ax.set_ylabel("loss (nats/byte)")
        start = f" (t = 0 at {utc_label(t0)})" if lows else ""
        ax.set_title(f"Training and eval loss per node{start}")
        ax.grid(True, alpha=0.3)
        ax.set_xlim(left=0)
        return save_png(fig, path)


def plot_links(logs: Mapping[str, NodeLog], out: Path) -> Path:
    """``link_bandwidth.png``: measured goodput (Mbit/s) and RTT (ms) over time, one line per node -> peer link."""
    path = png_path(out, LINK_PNG)
    t0 = run_start(logs)
    series: list[tuple[str, list[float], list[float], list[float]]] = []
    for node_id, node in logs.items():
        for peer in sorted({r["peer"] for r in node.links}):
            recs = [r for r in node.links if r["peer"] == peer]
            series.append(
                (
                    f"{node_id} → {peer}",
                    [r["t"] - t0 for r in recs],
                    [r["goodput_Bps"] * 8 / 1e6 for r in recs],
                    [r["rtt_s"] * 1e3 for r in recs],
                )
            )
    with agg_figure((SIZE[0], 6.5)) as fig:
        ax_bw, ax_rtt = fig.subplots(2, 1, sharex=True, height_ratios=(3, 2))
        marker = "o" if max((len(s[1]) for s in series), default=0) <= 60 else None
        for color, (label, xs, bw, rtt) in zip(node_colors(len(series)), series, strict=True):
            ax_bw.plot(xs, bw, color=color, lw=1.3, marker=marker, ms=3, label=label)
            ax_rtt.plot(xs, rtt, color=color, lw=1.3, marker=marker, ms=3)
        if series:
            ax_bw.set_ylim(bottom=0)
            ax_rtt.set_ylim(bottom=0)
            fig.legend(loc="outside right upper", title="link", ncols=1 if len(series) <= 16 else 2)
        else:
            no_data(ax_bw, "no link measurements yet")
        ax_bw.set_ylabel("goodput (Mbit/s)")
        ax_rtt.set_ylabel("RTT (ms)")
        ax_rtt.set_xlabel("wall-clock time (s)")
        ax_bw.set_title("Measured link goodput" + (f" (t = 0 at {utc_label(t0)})" if series else ""))
        ax_rtt.set_title("Round-trip time", fontsize=11)
        for ax in (ax_bw, ax_rtt):
            ax.grid(True, alpha=0.3)
        ax_rtt.set_xlim(left=0)
        return save_png(fig, path)
