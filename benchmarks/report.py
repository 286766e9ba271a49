"""Output helpers shared by the benchmarks: markdown tables, MiB, load average, wall+CPU clocks."""

from __future__ import annotations

import os
import time
from collections.abc import Callable


def table(title: str, header: list[str], rows: list[list]) -> str:
    """Print and return a markdown table (first column left-aligned, the rest right-aligned)."""
    rows = [[str(c) for c in r] for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]

    def line(cells):
        return "| " + " | ".join(str(c).rjust(w) if i else str(c).ljust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"
    sep = "|" + "|".join(("-" * (w + 1) + ":") if i else ("-" * (w + 2)) for i, w in enumerate(widths)) + "|"
    text = "\n".join([f"\n{title}\n", line(header), sep] + [line(r) for r in rows])
    print(text, flush=True)
    return text


def mib(n: float, digits: int = 2) -> str:
    return f"{n / 2**20:,.{digits}f}"


def load() -> str:
    """The load average: benchmarks on a shared machine say how busy it was."""
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


class Clock:
    """Wall and CPU seconds since construction; `sync` (e.g. torch.cuda.synchronize) runs at both ends."""

    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        self.sync = sync or (lambda: None)
        self.sync()
        self.w, self.c = time.perf_counter(), time.process_time()

    def read(self) -> tuple[float, float]:
        self.sync()
        return time.perf_counter() - self.w, time.process_time() - self.c
