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


def plot_profile(report: Any, path: str) -> None:
    """Left: step time per world size split into compute (incl. optimizer) and exposed
    communication. Right: all-reduce bus bandwidth and scaling efficiency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in report.runs if r.status == "ok"]
    labels = [str(r.world_size) for r in runs]
    compute = [(r.compute_s or 0.0) * 1e3 for r in runs]
    exposed = [(r.exposed_comm_s or 0.0) * 1e3 for r in runs]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(labels, compute, label="compute (no_sync) + optimizer")
    left.bar(labels, exposed, bottom=compute, label="exposed communication")
    left.set_xlabel("world size")
    left.set_ylabel("ms per step (slowest rank, median)")
    left.legend(loc="upper left")
    left.set_ylim(0, max((c + e for c, e in zip(compute, exposed)), default=1.0) * 1.3)
    sizes = [r.world_size for r in runs if r.busbw_gbps is not None]
    busbw = [r.busbw_gbps for r in runs if r.busbw_gbps is not None]
    right.plot(sizes, busbw, marker="o", color="tab:green", label="bus bandwidth")
    right.set_xlabel("world size")
    right.set_xticks([r.world_size for r in runs])
    right.set_ylim(bottom=0)
    right.set_ylabel("all-reduce bus bandwidth, GB/s")
    twin = right.twinx()
    twin.plot([r.world_size for r in runs], [(r.scaling_efficiency or 0.0) * 100 for r in runs], marker="s",
              color="tab:red", label="scaling efficiency")
    twin.set_ylabel("scaling efficiency, %")
    twin.set_ylim(0, 110)
    right.legend(handles=right.get_lines() + twin.get_lines(), loc="upper right")
    backends = sorted({r.backend for r in runs}) or ["-"]
    fig.suptitle(f"ddparity profile: {report.case} ({', '.join(backends)}, {report.cpus} CPUs)")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    except OSError as exc:
        raise UsageError(f"cannot write the plot to {path!r}: {exc.strerror}") from None
    finally:
        plt.close(fig)
