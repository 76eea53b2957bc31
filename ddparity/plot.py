"""``ddparity profile --plot``: the profile as a picture (matplotlib, optional)."""

from __future__ import annotations

import os
from typing import Any

from ddparity.errors import UsageError

FORMATS = (".png", ".svg", ".pdf")
ABOVE: dict[str, Any] = {"loc": "lower center", "bbox_to_anchor": (0.5, 1.01), "ncol": 2, "frameon": False}
"""Where every panel's legend stands: over the panel, outside it."""


def check_plot_path(path: str) -> None:
    """Fail early, naming the fix: a format we write, a folder that exists, matplotlib."""
    if not path.lower().endswith(FORMATS):
        raise UsageError(f"--plot {path!r}: use a file name ending in {', '.join(FORMATS)}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"--plot {path!r}: folder {folder!r} does not exist")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install matplotlib (or, in a clone of ddparity, pip install -e \".[plot]\")") from None


def figure(report: Any) -> Any:
    """Top left: step time per arm and world size split into compute (incl. optimizer) and
    exposed communication. Top right: all-reduce bus bandwidth and scaling efficiency.
    Bottom left: the memory a rank holds in a step (parameters, gradients, optimizer state,
    DDP's bucket copies, activations; a GPU's peak allocated). Every world size profiled or
    not keeps its place on these panels' x axes, evenly spaced. Bottom right: the bucket-size
    curve of a ``--bucket-cap-mb`` sweep (step p50 to p95, exposed communication, per world
    size)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = {m: i for i, m in enumerate(dict.fromkeys(r.label for r in report.runs))}  # a mode, or a sweep's arm
    every = sorted(report.runs, key=lambda r: (order[r.label], r.world_size))  # a skipped or failed size keeps its place
    at = {id(r): i for i, r in enumerate(every)}
    runs = [r for r in every if r.status == "ok"]
    ticks = list(range(len(every)))
    modes = len(order) > 1
    names = [(f"{r.label}, " if modes else "") + (str(r.world_size) if r.status == "ok" else f"{r.world_size}\n({r.status})")
             for r in every]
    compute = [(r.compute_s or 0.0) * 1e3 for r in runs]
    exposed = [(r.exposed_comm_s or 0.0) * 1e3 for r in runs]
    fig, ((left, right), (memory, curve)) = plt.subplots(2, 2, figsize=(11, 9.2))
    xs = [at[id(r)] for r in runs]
    left.bar(xs, compute, label="compute (no_sync) + optimizer")
    left.bar(xs, exposed, bottom=compute, label="exposed communication")
    left.set_ylabel("ms per step (slowest rank, median)")
    left.set_ylim(0, max((c + e for c, e in zip(compute, exposed)), default=1.0) * 1.15)
    with_bw = [r for r in runs if r.busbw_gbps is not None]
    for i, label in enumerate(order):  # one line an arm: no line joins two arms' figures
        mine = [r for r in with_bw if r.label == label]
        right.plot([at[id(r)] for r in mine], [r.busbw_gbps for r in mine], marker="o", color="tab:green",
                   label="bus bandwidth" if i == 0 else "_")
    right.set_ylim(0, max((r.busbw_gbps for r in with_bw), default=1.0) * 1.15)
    right.set_ylabel("all-reduce bus bandwidth, GB/s")
    twin = right.twinx()
    for i, label in enumerate(order):  # one line an arm: scaling is against that arm's smallest world
        mine = [r for r in runs if r.label == label and r.scaling_efficiency is not None]
        twin.plot([at[id(r)] for r in mine], [r.scaling_efficiency * 100 for r in mine], marker="s",
                  color="tab:red", label="scaling efficiency" if i == 0 else "_")
    twin.set_ylabel("scaling efficiency, %")
    twin.set_ylim(0, 110)
    _memory(memory, runs, [at[id(r)] for r in runs])
    for ax in (left, right, memory):  # the same world sizes, evenly spaced, on these panels
        if modes:  # arms' names are long: slanted, each ending under its bar
            ax.set_xticks(ticks, names, rotation=30, ha="right", rotation_mode="anchor", fontsize=8)
        else:
            ax.set_xticks(ticks, names)
        ax.set_xlim(-0.6, len(every) - 0.4)
        ax.set_xlabel("mode and world size" if modes else "world size")
    _bucket_curve(curve, runs)
    # legends over the panels, outside them: nothing drawn is hidden behind them, and no tick label runs into them
    left.legend(**ABOVE)
    right.legend(handles=[h for h in right.get_lines() + twin.get_lines() if not h.get_label().startswith("_")],
                 **ABOVE)
    if memory.get_legend_handles_labels()[0]:
        memory.legend(**{**ABOVE, "ncol": 3, "fontsize": 8})
    backends = sorted({r.backend for r in runs}) or ["-"]
    fig.suptitle(f"ddparity profile: {report.case} ({', '.join(backends)}, {report.cpus} CPUs)")
    notes = notes_of(every)
    line = 0.16 / fig.get_figheight()  # a note's height, as a share of the figure's
    fig.tight_layout(rect=(0, line * len(notes), 1, 1))
    for i, note in enumerate(notes):  # the table's notes travel with the picture (oversubscribed sizes, small messages)
        fig.text(0.01, line * (len(notes) - i) - 0.7 * line, note, fontsize=7.5, color="0.3")
    return fig


MEMORY = (("params", "parameters"), ("grads", "gradients"), ("optimizer", "optimizer state"),
          ("ddp_buckets", "DDP's bucket copies"), ("activations", "activations"))


def _memory(ax: Any, runs: list[Any], xs: list[int]) -> None:
    """What the largest rank holds in a step, stacked by kind; a GPU's peak allocated as a mark."""
    bottom = [0.0] * len(runs)
    for key, label in MEMORY:
        sizes = [((r.memory_per_rank or {}).get(key) or 0) / 1e6 for r in runs]
        if any(sizes):
            ax.bar(xs, sizes, bottom=bottom, label=label)
            bottom = [b + size for b, size in zip(bottom, sizes)]
    peaks = [(x, r.memory_per_rank["peak_allocated"] / 1e6) for x, r in zip(xs, runs)
             if (r.memory_per_rank or {}).get("peak_allocated")]
    if peaks:
        ax.plot([x for x, _ in peaks], [p for _, p in peaks], "k_", markersize=18, mew=2, label="peak allocated (GPU)")
    ax.set_ylim(0, max([*bottom, *(p for _, p in peaks), 1e-3]) * 1.15)
    ax.set_ylabel("MB a rank holds in a step")


def _bucket_curve(ax: Any, runs: list[Any]) -> None:
    """Step time against the bucket cap, one line a world size (p50, bars to p95), and the
    exposed communication dashed; where no sweep gives two caps or more, says how to draw it."""
    swept = sorted((r for r in runs if r.bucket_cap_mb is not None), key=lambda r: (r.world_size, r.bucket_cap_mb))
    sizes = [ws for ws in dict.fromkeys(r.world_size for r in swept)
             if len({r.bucket_cap_mb for r in swept if r.world_size == ws}) > 1]
    if not sizes:
        ax.axis("off")
        ax.text(0.5, 0.5, "bucket-size curve: sweep DDP's bucket cap\n(--bucket-cap-mb 1,5,25,100) to draw it",
                ha="center", va="center", color="0.4", transform=ax.transAxes)
        return
    for i, ws in enumerate(sizes):
        mine = [r for r in swept if r.world_size == ws]
        caps = [r.bucket_cap_mb for r in mine]
        steps = [r.step_s * 1e3 for r in mine]
        tails = [max((r.step_p95_s or r.step_s) * 1e3 - s, 0.0) for r, s in zip(mine, steps)]
        color = f"C{i}"
        ax.errorbar(caps, steps, yerr=[[0.0] * len(steps), tails], marker="o", color=color, capsize=3,
                    label=f"{ws} rank(s): step p50 (bar to p95)")
        ax.plot(caps, [(r.exposed_comm_s or 0.0) * 1e3 for r in mine], linestyle="--", marker=".", color=color,
                label=f"{ws} rank(s): exposed communication")
    ax.set_xscale("log")
    caps = sorted({r.bucket_cap_mb for r in swept})
    ax.set_xticks(caps, [f"{c:g}" for c in caps])
    ax.minorticks_off()
    ax.set_ylim(bottom=0)
    ax.set_xlabel("DDP bucket cap, MB")
    ax.set_ylabel("ms per step")
    ax.legend(**{**ABOVE, "fontsize": 8})


DRAWN = ("state a rank holds", "DDP's own logging: ", "one rank: ")
"""Notes the picture shows or needs not repeat: the memory panel, DDP's logging where it agrees."""


def notes_of(runs: list[Any], width: int = 150) -> list[str]:
    """The notes the profile's table prints under it, one line each (cut at ``width``),
    less those the picture draws (:data:`DRAWN`)."""
    out = []
    for r in runs:
        for note in r.notes:
            if note.startswith(DRAWN):
                continue
            line = f"{r.label} world size {r.world_size}: {note}"
            out.append(line if len(line) <= width else line[:width - 3] + "...")
    return out


def plot_profile(report: Any, path: str) -> None:
    """The profile's figure (:func:`figure`) written to ``path``."""
    import matplotlib.pyplot as plt

    fig = figure(report)
    try:
        fig.savefig(path, dpi=100)
    except OSError as exc:
        raise UsageError(f"cannot write the plot to {path!r}: {exc.strerror}") from None
    finally:
        plt.close(fig)
