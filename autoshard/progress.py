"""Stage-by-stage progress for long plans: a rich status line on a terminal, silence elsewhere
(pipes, CI logs, tests), so planning a 70B model shows where its seconds go."""

from __future__ import annotations

import contextlib
import sys
import time


class Progress:
    def __init__(self, enabled: bool | None = None):
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._console = None
        if self.enabled:
            from rich.console import Console

            self._console = Console(stderr=True)

    @contextlib.contextmanager
    def stage(self, name: str):
        """Shows ``name`` while it runs, then how long it took."""
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        with self._console.status(f"autoshard: {name}..."):
            yield
        self._console.log(f"autoshard: {name} [dim]{time.perf_counter() - start:.1f}s[/dim]")
