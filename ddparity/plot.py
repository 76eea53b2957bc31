"""``ddparity profile --plot``: the profile as a picture (matplotlib, optional)."""

from __future__ import annotations

import os
from typing import Any

from ddparity.errors import UsageError

FORMATS = (".png", ".svg", ".pdf")


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
    """Left: step time per world size split into compute (incl. optimizer) and exposed
    communication. Right: all-reduce bus bandwidth and scaling efficiency. Every world size
    profiled or not keeps its place on both panels' x axes, evenly spaced."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = {m: i for i, m in enumerate(dict.fromkeys(r.label for r in report.runs))}  # a mode, or a sweep's arm
    every = sorted(report.runs, key=lambda r: (order[r.label], r.world_size))  # a skipped or failed size keeps its place
    at = {id(r): i for i, r in enumerate(every)}
    runs = [r for r in every if r.status == "ok"]
    ticks = list(range(len(every)))
    modes = len(order) > 1
    names = [(f"{r.label} " if modes else "") + (str(r.world_size) if r.status == "ok" else f"{r.world_size}\n({r.status})")
             for r in every]
    compute = [(r.compute_s or 0.0) * 1e3 for r in runs]
    exposed = [(r.exposed_comm_s or 0.0) * 1e3 for r in runs]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.6))
    xs = [at[id(r)] for r in runs]
    left.bar(xs, compute, label="compute (no_sync) + optimizer")
    left.bar(xs, exposed, bottom=compute, label="exposed communication")
    left.set_ylabel("ms per step (slowest rank, median)")
    left.set_ylim(0, max((c + e for c, e in zip(compute, exposed)), default=1.0) * 1.15)
    with_bw = [r for r in runs if r.busbw_gbps is not None]
    right.plot([at[id(r)] for r in with_bw], [r.busbw_gbps for r in with_bw], marker="o", color="tab:green",
               label="bus bandwidth")
    right.set_ylim(0, max((r.busbw_gbps for r in with_bw), default=1.0) * 1.15)
    right.set_ylabel("all-reduce bus bandwidth, GB/s")
    twin = right.twinx()
    for i, label in enumerate(order):  # one line an arm: scaling is against that arm's smallest world
        mine = [r for r in runs if r.label == label]
        twin.plot([at[id(r)] for r in mine], [(r.scaling_efficiency or 0.0) * 100 for r in mine], marker="s",
                  color="tab:red", label="scaling efficiency" if i == 0 else "_")
    twin.set_ylabel("scaling efficiency, %")
    twin.set_ylim(0, 110)
    for ax in (left, right):  # the same world sizes, evenly spaced, on both panels
        ax.set_xticks(ticks, names)
        ax.set_xlim(-0.6, len(every) - 0.4)
        ax.set_xlabel("mode and world size" if modes else "world size")
    # legends under the panels: nothing drawn is ever hidden behind them
    left.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
    right.legend(handles=[h for h in right.get_lines() + twin.get_lines() if not h.get_label().startswith("_")], loc="upper center", bbox_to_anchor=(0.5, -0.2),
                 ncol=2, frameon=False)
    backends = sorted({r.backend for r in runs}) or ["-"]
    fig.suptitle(f"ddparity profile: {report.case} ({', '.join(backends)}, {report.cpus} CPUs)")
    notes = notes_of(every)
    fig.tight_layout(rect=(0, 0.035 * len(notes), 1, 1))
    for i, note in enumerate(notes):  # the table's notes travel with the picture (oversubscribed sizes, small messages)
        fig.text(0.01, 0.035 * (len(notes) - i) - 0.025, note, fontsize=7.5, color="0.3")
    return fig


def notes_of(runs: list[Any], width: int = 150) -> list[str]:
    """The notes the profile's table prints under it, one line each (cut at ``width``)."""
    out = []
    for r in runs:
        for note in r.notes:
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
