"""The schedule's Gantt chart: one steady-state period of a DreamDDP plan, replayed by `schedule.simulate`."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dreamp2p.devtools.report.draw import SIZE, agg_figure, png_path, save_png
from dreamp2p.devtools.report.runlog import GANTT_PNG
from dreamp2p.schedule.cost import LayerCost, LinkModel
from dreamp2p.schedule.plan import Plan
from dreamp2p.schedule.simulate import IterationTimeline, simulate

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

_FWD_COLOR = "#a6cee3"
_BWD_COLOR = "#1f78b4"
_WAIT_COLOR = "#fbb4ae"
_WAIT_EDGE = "#d62728"
_SYNC_COLOR = "#ff7f0e"
_REPEAT_COLOR = "#fdd0a2"
_REPEAT_EDGE = "#d95f02"
_WINDOW_COLOR = "#1f78b4"
_BAR = 0.7  # height of a bar in its lane


def plan_inputs(plan_json: Mapping[str, Any]) -> tuple[Plan, list[LayerCost], LinkModel]:
    """Plan, layer costs and link of a plan.json object; ValueError naming what is wrong."""
    if not isinstance(plan_json, Mapping):
        raise ValueError(f"plan.json must be an object, got {type(plan_json).__name__}")
    try:
        plan = Plan.from_dict(plan_json["plan"])
        raw_costs = plan_json["costs"]
        if not isinstance(raw_costs, list):
            raise ValueError("plan.json 'costs' must be a list")
        costs = [LayerCost(c["name"], c["fwd_s"], c["bwd_s"], c["nbytes"]) for c in raw_costs]
        ld = plan_json["link"]
        link = LinkModel(
            bandwidth_Bps=ld["bandwidth_Bps"],
            rtt_s=ld["rtt_s"],
            world=ld["world"],
            codec_ratio=ld.get("codec_ratio", 1.0),
            per_hop_overhead_s=ld.get("per_hop_overhead_s", 0.0),
        )
    except KeyError as exc:
        raise ValueError(f"plan.json lacks field {exc}") from exc
    except (TypeError, AttributeError) as exc:
        raise ValueError(f"malformed plan.json: {exc}") from exc
    return plan, costs, link


def _fmt_s(seconds: float) -> str:
    if seconds == 0:
        return "0 s"
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _layer_range(layers: Sequence[int]) -> tuple[str, str]:
    """Long and short label of a sync's layers (forward indices)."""
    a, b = layers[0], layers[-1]
    if len(layers) == 1:
        return f"L{a}", f"{a}"
    if b - a + 1 == len(layers):
        return f"L{a}–{b}", f"{a}–{b}"
    return f"L{a}…{b} ({len(layers)})", f"{a}…{b}"


_Label = tuple[float, float, float, list[str], bool]


def _fit_labels(fig: Figure, ax: Axes, labels: list[_Label]) -> None:
    """Place each label (x0, x1, y, candidates longest first, on a hatched bar) in its bar: the longest that fits.

    The shortest candidate is tried once more in a smaller font; a bar too narrow for any gets none. Labels on
    hatched bars get a white box so that they stay readable.
    """
    fig.draw_without_rendering()  # runs the layout so that data -> pixel transforms are final
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    box = {"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none", "alpha": 0.8}
    for x0, x1, y, candidates, hatched in labels:
        px0, _ = ax.transData.transform((x0, y))
        px1, _ = ax.transData.transform((x1, y))
        room = abs(px1 - px0) - 4
        tries = [(text, 8.0) for text in candidates] + [(candidates[-1], 6.5)]
        for text, size in tries:
            artist = ax.text((x0 + x1) / 2, y, text, ha="center", va="center", fontsize=size, clip_on=True)
            if hatched:
                artist.set_bbox(box)
            artist.set_in_layout(False)
            if artist.get_window_extent(renderer).width <= room:
                break
            artist.remove()


def plot_gantt(plan_json: dict[str, Any], out: Path) -> Path:
    """``schedule_gantt.png``: one steady-state period of the plan in ``plan_json`` (plan.json), from ``simulate``.

    Per iteration a band of two lanes: "compute" (forward light, backward dark, exposed wait hatched red) and
    "link" (syncs launched in that iteration, labelled with their layer range and delay; bubble-filling repeats
    hatched; the iteration's backward window shaded). Raises ValueError for a malformed plan.json.
    """
    plan, costs, link = plan_inputs(plan_json)
    timeline: list[IterationTimeline] = simulate(plan, costs, link)
    path = png_path(out, GANTT_PNG)
    H, L = plan.period, len(costs)
    period_end = timeline[-1].end_s
    comm_end = max((c.end_s for it in timeline for c in it.comm), default=0.0)
    x_max = max(period_end, comm_end)
    x_max = x_max if x_max > 0 else 1.0
    lanes = 2 * H
    height = min(18.0, max(4.5, 2.2 + 0.36 * lanes))
    edge = 0.5 if L <= 24 else 0.0  # white borders between layers; with many layers they would look like noise
    with agg_figure((SIZE[0], height)) as fig:
        ax = fig.add_subplot()
        labels: list[_Label] = []
        for h, it in enumerate(timeline):
            _draw_compute(ax, h, it, edge, labels)
            _draw_link(ax, h, it, H, labels)
        ax.axvline(period_end, color="grey", ls=":", lw=0.8, zorder=1)
        ax.set_yticks(
            range(lanes), [f"iter {h // 2} {'compute' if h % 2 == 0 else 'link'}" for h in range(lanes)], fontsize=9
        )
        ax.set_ylim(lanes - 0.5, -0.5)
        ax.set_xlim(0, x_max * 1.02)
        ax.set_xlabel("time within period (s)")
        ax.grid(True, axis="x", alpha=0.3)
        ax.set_axisbelow(True)
        ax.set_title(_gantt_title(plan, link, timeline), fontsize=11)
        _gantt_legend(fig)
        _fit_labels(fig, ax, labels)
        return save_png(fig, path)


def _draw_compute(ax: Axes, h: int, it: IterationTimeline, edge: float, labels: list[_Label]) -> None:
    """Iteration ``h``'s compute lane: its band shading, forward and backward blocks, and its exposed wait."""
    yc, yl = 2 * h, 2 * h + 1
    if h % 2 == 0:
        ax.axhspan(yc - 0.5, yl + 0.5, color="#f3f3f3", zorder=0, lw=0)
    ax.axvline(it.start_s, color="grey", ls=":", lw=0.8, zorder=1)
    fwd = [(b.start_s, b.end_s - b.start_s) for b in it.compute if b.phase == "fwd"]
    bwd = [(b.start_s, b.end_s - b.start_s) for b in it.compute if b.phase == "bwd"]
    box = (yc - _BAR / 2, _BAR)
    ax.broken_barh(fwd, box, facecolors=_FWD_COLOR, edgecolors="white", linewidth=edge, zorder=2)
    ax.broken_barh(bwd, box, facecolors=_BWD_COLOR, edgecolors="white", linewidth=edge, zorder=2)
    if it.exposed_s > 0:
        ax.broken_barh(
            [(it.backward_end_s, it.exposed_s)],
            box,
            facecolors=_WAIT_COLOR,
            edgecolors=_WAIT_EDGE,
            hatch="xx",
            linewidth=0.8,
            zorder=2,
        )
        wait = _fmt_s(it.exposed_s)
        labels.append((it.backward_end_s, it.end_s, yc, [f"wait {wait}", wait], True))


def _draw_link(ax: Axes, h: int, it: IterationTimeline, H: int, labels: list[_Label]) -> None:
    """Iteration ``h``'s link lane: its backward window and the syncs it launches (repeats hatched)."""
    yl = 2 * h + 1
    window = it.backward_end_s - it.backward_start_s
    ax.broken_barh(
        [(it.backward_start_s, window)],
        (yl - 0.45, 0.9),
        facecolors=_WINDOW_COLOR,
        alpha=0.1,
        linewidth=0,
        zorder=1,
    )
    for c in it.comm:
        delay = (c.due_iteration - c.launch_iteration) % H
        long, short = _layer_range(c.layers)
        if c.end_s <= c.start_s:
            ax.vlines(c.start_s, yl - _BAR / 2, yl + _BAR / 2, colors=_SYNC_COLOR, linewidth=1.5, zorder=3)
            continue
        ax.broken_barh(
            [(c.start_s, c.end_s - c.start_s)],
            (yl - _BAR / 2, _BAR),
            facecolors=_REPEAT_COLOR if c.repeat else _SYNC_COLOR,
            edgecolors=_REPEAT_EDGE if c.repeat else "#8c4a06",
            hatch="///" if c.repeat else None,
            linewidth=0.6,
            zorder=3,
        )
        tail, tail_short = (f", delay {delay}", f" +{delay}") if delay else ("", "")
        layers_word = "layers " + long[1:] if len(c.layers) > 1 else "layer " + long[1:]
        candidates = [layers_word + tail, long + tail_short, short + tail_short]
        labels.append((c.start_s, c.end_s, yl, candidates, c.repeat))
    if not it.comm:
        ax.text(it.backward_start_s, yl, " no sync", ha="left", va="center", fontsize=8, color="grey", zorder=3)


def _gantt_title(plan: Plan, link: LinkModel, timeline: Sequence[IterationTimeline]) -> str:
    """The chart's title: the plan, its predicted exposed wait, the compute time and the link."""
    H, total_wait = plan.period, math.fsum(it.exposed_s for it in timeline)
    if total_wait > 0:
        wait_text = f"predicted exposed wait {_fmt_s(total_wait)} per period ({_fmt_s(total_wait / H)} per step)"
    else:
        wait_text = "predicted exposed wait 0: all syncs hidden"
    if all(c.end_s <= c.start_s for it in timeline for c in it.comm):
        link_text = f"no link traffic (world {link.world}: comm time 0)"
    else:
        link_text = (
            f"link {link.bandwidth_Bps * 8 / 1e6:.1f} Mbit/s, RTT {link.rtt_s * 1e3:.0f} ms, "
            f"world {link.world}, codec ratio {link.codec_ratio:g}"
        )
    return (
        f"DreamDDP schedule: plan v{plan.version}, period H = {H}, {len(plan.layer_names)} layers\n{wait_text}\n"
        f"compute {_fmt_s(plan.compute_s)} per iteration; {link_text}"
    )


def _gantt_legend(fig: Figure) -> None:
    from matplotlib.patches import Patch

    handles = [
        Patch(facecolor=_FWD_COLOR, label="forward"),
        Patch(facecolor=_BWD_COLOR, label="backward"),
        Patch(facecolor=_WAIT_COLOR, edgecolor=_WAIT_EDGE, hatch="xx", label="exposed wait"),
        Patch(facecolor=_WINDOW_COLOR, alpha=0.1, label="backward window"),
        Patch(facecolor=_SYNC_COLOR, edgecolor="#8c4a06", label="sync (ring all-reduce)"),
        Patch(facecolor=_REPEAT_COLOR, edgecolor=_REPEAT_EDGE, hatch="///", label="repeat sync (bubble fill)"),
    ]
    fig.legend(handles=handles, loc="outside lower center", ncols=6, fontsize=8.5, frameon=False)
