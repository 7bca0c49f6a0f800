# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The PNG: loss curves and step times of every run (matplotlib is optional)."""

from typing import Any, Dict, Optional


def write_plot(path: str, report: Dict[str, Any]) -> Optional[str]:
    """Draw the plot; returns ``None`` on success, else why it was skipped."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib); no plot written"
    scenarios = list(report["worlds"])
    fig, axes = plt.subplots(len(scenarios), 2, figsize=(12, 3.6 * len(scenarios)), squeeze=False)
    for row, scenario in enumerate(scenarios):
        runs = [r for r in report["runs"] if r["scenario"] == scenario and not r.get("skipped")]
        loss_ax, time_ax = axes[row]
        for r in runs:
            steps = range(1, len(r["loss"]) + 1)
            loss_ax.plot(steps, r["loss"], label=r["label"], linewidth=1.2)
            time_ax.plot(steps, [s * 1e3 for s in r["step_s"]], label=r["label"], linewidth=1.2)
        loss_ax.set_title(f"{scenario}: loss per step")
        loss_ax.set_xlabel("step")
        loss_ax.set_ylabel("loss")
        time_ax.set_title(f"{scenario}: step time (slowest rank)")
        time_ax.set_xlabel("step")
        time_ax.set_ylabel("ms")
        for ax in (loss_ax, time_ax):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
