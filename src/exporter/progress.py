"""Progress for the long stages, on stderr, so stdout stays clean for machine-readable output."""

from __future__ import annotations

import contextlib
import time

from rich.console import Console

from . import interrupts
from .supervisor import report


class Progress:
    def __init__(self, enabled: bool = True, console: Console | None = None):
        self.enabled = enabled
        # soft wrap: a long line stays one line in a CI log (rich would fold it at 80 columns off a terminal)
        self.console = console or Console(stderr=True, highlight=False, soft_wrap=True)
        self.timings: dict[str, float] = {}
        self.current: str | None = None  # the stage under way (read by the memory sampler's thread)

    def info(self, message: str) -> None:
        if self.enabled:
            self.console.print(f"  {message}")

    def warn(self, message: str) -> None:
        if self.enabled:
            self.console.print(f"  [yellow]warning:[/] {message}")

    @contextlib.contextmanager
    def stage(self, name: str, detail: str = ""):
        """Time and show one stage; every stage boundary is also where a recorded signal stops the run."""
        interrupts.check()
        t0 = time.perf_counter()
        label = f"{name}{': ' + detail if detail else ''}"
        status = (self.console.status(f"{label} ...") if self.enabled and self.console.is_terminal
                  else contextlib.nullcontext())
        outer, self.current = self.current, name
        report("stage", name)  # told before it is shown: whoever acts on the line sees the parent know it
        if self.enabled and not self.console.is_terminal:
            self.console.print(f"{label} ...")
        try:
            with status:
                yield
            interrupts.check()
        except BaseException:
            self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - t0
            if self.enabled:
                self.console.print(f"[red]✗[/] {label} failed after {time.perf_counter() - t0:.1f} s")
            raise
        finally:
            self.current = outer
            if outer is not None:
                report("stage", outer)
        elapsed = time.perf_counter() - t0
        self.timings[name] = self.timings.get(name, 0.0) + elapsed
        if self.enabled:
            self.console.print(f"[green]✓[/] {label} ({elapsed:.1f} s)")
