"""Output helpers shared by the benchmarks: the repo root and results folder, markdown tables, MiB, load average,
CPU name, wall+CPU clocks, a private Prefect API."""

from __future__ import annotations

import atexit
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository: configs, runs and git live here
RESULTS = ROOT / "benchmarks" / "results"  # the tables (JSONL) and plots kept in git


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


def cpu_name() -> str:
    """The CPU's model name: results from machines of one kind differ by CPU."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


class Clock:
    """Wall and CPU seconds since construction; `sync` (e.g. torch.cuda.synchronize) runs at both ends."""

    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        self.sync = sync or (lambda: None)
        self.sync()
        self.w, self.c = time.perf_counter(), time.process_time()

    def read(self) -> tuple[float, float]:
        self.sync()
        return time.perf_counter() - self.w, time.process_time() - self.c


def private_prefect_env() -> Path | None:
    """Point Prefect at a fresh local server's home and port unless PREFECT_API_URL is set; returns
    that home (the caller starts the server there) or None. Call before anything imports Prefect:
    it reads its settings at import."""
    home = None
    if not os.environ.get("PREFECT_API_URL"):
        from serving.llamacpp.server import free_port  # imports no Prefect

        home = Path(tempfile.mkdtemp(prefix="eagle3-bench-prefect-"))
        atexit.register(shutil.rmtree, home, ignore_errors=True)  # also after --help or an error
        os.environ["PREFECT_HOME"] = str(home)
        os.environ["PREFECT_API_URL"] = f"http://127.0.0.1:{free_port()}/api"
    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    return home
