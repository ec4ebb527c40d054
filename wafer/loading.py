"""Loading a model for a command or the server, with a progress bar on stderr."""

from __future__ import annotations

from typing import TYPE_CHECKING

from wafer.config import LoadSettings

if TYPE_CHECKING:
    from wafer.models.loader import LoadedModel


def load_with_progress(model: str | None, quiet: bool = False, compute: str = LoadSettings.quant,
                       device: str = LoadSettings.device) -> "LoadedModel":
    """Load a model, with a progress bar on stderr. Device `auto`: CUDA where there is a GPU."""
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from wafer.models.loader import load_model

    torch.set_num_threads(torch.get_num_threads())
    console = Console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} layers"),
                  TimeElapsedColumn(), console=console, disable=quiet, transient=True) as bar:
        task = bar.add_task(f"loading {model or 'default model'}", total=None)
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        loaded = load_model(model, progress=lambda i, n: bar.update(task, completed=i, total=n), compute=compute,
                            device=device)
    if not quiet:
        console.print(f"[dim]loaded {loaded.name} ({loaded.config.arch}, {loaded.num_parameters / 1e6:.0f}M parameters)[/]")
    return loaded
