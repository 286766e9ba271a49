"""The scale rehearsal's processes: the scripted baseline servers, each stage's process with its peak memory
and CPU sampled while it runs, and the `eagle3` command line they run.

Promises: the servers restart on the same ports (an outage ends as a restart), and a stage's usage counts
its children too (Prefect's and Dask's processes).
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from benchmarks.report import ROOT
from serving.scripted_server import spawn


@dataclass
class Servers:
    """The scripted baseline servers, restartable on the same ports (an outage ends as a restart)."""

    ports: list[int]
    args: list[str]
    log_dir: Path
    procs: list[subprocess.Popen] = field(default_factory=list)
    totals: list[dict] = field(default_factory=list)  # counters of incarnations that ended

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    def start(self) -> None:
        self.procs = [spawn(*self.args, "--seed", str(n + 100 * len(self.totals)), port=p,
                            log_path=self.log_dir / f"server-{p}.log")[0] for n, p in enumerate(self.ports)]

    def metrics(self) -> list[dict | None]:
        out = []
        for u in self.urls:
            try:
                out.append(httpx.get(u + "/metrics", timeout=2.0).json())
            except httpx.HTTPError:
                out.append(None)
        return out

    def kill(self) -> None:
        self.totals.append({"metrics": self.metrics()})
        for p in self.procs:
            p.kill()
            p.wait()
        self.procs = []


def tree_usage(proc: psutil.Process) -> tuple[int, float]:
    """(RSS bytes, CPU seconds) of a process and its children, now."""
    rss, cpu = 0, 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            rss += p.memory_info().rss
            t = p.cpu_times()
            cpu += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            pass
    return rss, cpu


@dataclass
class StageRun:
    """One stage process: its peak RSS and CPU, sampled while it runs."""

    proc: subprocess.Popen
    started: float
    peak_rss: int = 0
    cpu_s: float = 0.0

    def sample(self) -> None:
        try:
            rss, cpu = tree_usage(psutil.Process(self.proc.pid))
        except psutil.Error:
            return
        self.peak_rss = max(self.peak_rss, rss)
        self.cpu_s = max(self.cpu_s, cpu)


def start_stage(cmd: list[str], env: dict, log: Path) -> StageRun:
    with open(log, "ab") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    return StageRun(proc, time.monotonic())


def eagle3(*args: str) -> list[str]:
    return [sys.executable, "-m", "flows.cli", *args]
