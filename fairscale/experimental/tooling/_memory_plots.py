# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Plots of layer memory traces (matplotlib and Pillow are optional and imported only here, when plotting)."""

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Sequence, Tuple

__all__ = ["compare_memory_traces_in_plot", "matplotlib_figure_to_image", "null_context"]

_MISSING = (
    "Visualizing memory plots requires matplotlib and Pillow installed: pip install matplotlib, pip install Pillow"
)


@contextlib.contextmanager
def null_context() -> Iterator[None]:
    """A context manager that does nothing."""
    yield


def _import_plotting() -> Any:
    try:
        import matplotlib
        import PIL  # noqa: F401
    except ImportError:
        raise AssertionError(_MISSING)
    return matplotlib


def matplotlib_figure_to_image(fig: Any) -> Any:
    """Render a matplotlib figure into a ``PIL.Image`` in RGB mode."""
    _import_plotting()
    from PIL import Image

    fig.canvas.draw()
    width, height = fig.canvas.get_width_height()
    rgba = fig.canvas.buffer_rgba()
    return Image.frombuffer("RGBA", (width, height), bytes(rgba), "raw", "RGBA", 0, 1).convert("RGB")


def _short_name(name: str) -> str:
    # FSDP wrapper levels (``_fsdp_wrapped_module``, ``_fpw_module``) only clutter the annotation.
    return ".".join(part for part in name.split(".") if not part.startswith("_"))


def _series(traces: Sequence[Any], value: Callable[[Any], float]) -> Tuple[List[float], List[float]]:
    forward = [value(t) if t.is_forward else float("nan") for t in traces]
    backward = [float("nan") if t.is_forward else value(t) for t in traces]
    return forward, backward


def _panel(ax: Any, title: str, jobs: Dict[str, List[Any]], value: Callable[[Any], float], annotate: bool) -> None:
    ax.set_title(title)
    for job, traces in jobs.items():
        forward, backward = _series(traces, value)
        x = list(range(len(traces)))
        ax.plot(x, forward, label=f"{job} (fwd)" if len(jobs) > 1 else "fwd")
        ax.plot(x, backward, label=f"{job} (bwd)" if len(jobs) > 1 else "bwd")
        if annotate and traces:
            peak = max(range(len(traces)), key=lambda i: value(traces[i]))
            t = traces[peak]
            label = _short_name(t.module_name) + (" (fwd)" if t.is_forward else " (bwd)")
            ax.annotate(label, (peak, value(t)))
    if len(jobs) > 1:
        ax.legend()
    ax.ticklabel_format(axis="y", style="sci", scilimits=(9, 9))


def compare_memory_traces_in_plot(
    memory_traces_by_job: Dict[str, List[Any]], figsize: Tuple[int, int] = (16, 20), capture: bool = False
) -> Any:
    """Plot the memory traces of one or several jobs side by side (a 3 x 2 grid of panels).

    Args:
        memory_traces_by_job: job name -> list of :class:`LayerMemoryTrace`.
        figsize: the figure size in inches.
        capture: return the figure as a ``PIL.Image`` instead of showing it.

    Returns:
        The image when ``capture`` is true, else ``None``.

    Raises:
        AssertionError: matplotlib or Pillow is not installed (the message says what to install).
    """
    _import_plotting()
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 2, figsize=figsize)
    panels = [
        ("memory allocated", lambda t: t.allocated, True),
        ("memory reserved", lambda t: t.reserved, False),
        ("activation allocations", lambda t: t.event.memory_activations, False),
        ("cumulative forward activations", None, False),
        ("all gathered memory", lambda t: t.all_gathered, True),
        ("parameter memory", lambda t: t.module_params, False),
    ]
    for ax, (title, value, annotate) in zip(axes.flat, panels):
        if value is None:
            ax.set_title(title)
            for job, traces in memory_traces_by_job.items():
                forward = [t.event.memory_activations for t in traces if t.is_forward]
                running, total = [], 0
                for v in forward:
                    total += v
                    running.append(total)
                ax.plot(range(len(running)), running, label=job)
            if len(memory_traces_by_job) > 1:
                ax.legend()
            ax.ticklabel_format(axis="y", style="sci", scilimits=(9, 9))
        else:
            _panel(ax, title, memory_traces_by_job, value, annotate)
    if not capture:
        plt.show()
        return None
    image = matplotlib_figure_to_image(fig)
    plt.close(fig)
    return image
