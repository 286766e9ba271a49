"""Serving client: our `ServerPool` (serving/client.py) against the `openai` SDK, and saturation.

Every server is `python -m serving.scripted_server` in its own process on a free 127.0.0.1 port, so
the client's CPU time (`time.process_time()` of this process) is the client's alone.

1. Client overhead. One server that answers at once (latency 0, unlimited slots). N chat requests,
   C in flight at a time (C worker tasks pulling from one counter, the same driver for both sides):
   - ours:   `ServerPool([Endpoint(url, max_concurrency=C)], RetryPolicy())` + `pool.chat(...)`
   - openai: `AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=2)` +
             `client.chat.completions.create(...)`
   Each side runs `--rounds` times (default 2), alternating ours, openai, ours, openai, each run in a
   fresh event loop with a fresh client and an untimed warm-up of 2*C requests. The summary takes,
   per side, the best run (highest requests/s) and shows the mean of all runs next to it. Every
   answer is checked against `answer_for` after the clock stops.

2. Saturation. Servers with a fixed latency L and S slots (`--latency L --slots S`): at most S/L
   answers per second each. M requests are submitted at once (asyncio.gather) through our pool with
   `max_concurrency = S` per endpoint, so the pool is the only limiter. Reported: achieved requests/s
   over the ideal E*S/L (E endpoints), target >= 0.95; client CPU ms per request and the CPU-bound
   ceiling 1000 / (CPU ms per request), the most one client core could do at that cost. Run with one
   endpoint and with two (two server processes, 2*S slots in all). The default L = 0.5 s and S = 64
   give 128 answers/s per endpoint: far above a real baseline (Kimi-K2.5 on 8 GPUs writes ~830
   tok/s in all, about 2 answers/s), so a pass means the client is never the bottleneck.

    .venv/bin/python -m benchmarks.regenerate_client            # defaults, about 2 minutes
    .venv/bin/python -m benchmarks.regenerate_client --quick    # a smoke run, a few seconds
    .venv/bin/python -m benchmarks.regenerate_client --requests 5000 --concurrency 64 --sat-requests 5000

Throughput depends on what else the machine runs: the load average is printed before and after.
CPU ms per request is much less sensitive to that than requests/s.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass


import httpx

from serving.client import Endpoint, RetryPolicy, ServerPool
from serving.scripted_server import answer_for, spawn

MODEL = "scripted-model"
SAT_TARGET = 0.95
OVERHEAD_TARGET = 1.0  # ours/openai client CPU per request: no worse than the SDK


# ---------------------------------------------------------------- servers


class Server:
    """A scripted server subprocess on loopback; `stop()` kills it."""

    def __init__(self, *args: str, wait_s: float = 20.0):
        self.proc, self.url = spawn(*args, wait_s=wait_s)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


# ---------------------------------------------------------------- drivers


def messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"benchmark prompt {i}"}]


@dataclass
class Run:
    side: str
    requests: int
    wall_s: float
    cpu_s: float
    wrong: int
    split: dict | None = None

    @property
    def rps(self) -> float:
        return self.requests / self.wall_s

    @property
    def cpu_ms(self) -> float:
        return self.cpu_s / self.requests * 1e3


async def workers(call, n: int, c: int) -> list[str]:
    """n calls, c at a time; each worker takes the next index until none are left."""
    out: list[str] = [""] * n
    it = iter(range(n))

    async def worker() -> None:
        for i in it:
            out[i] = await call(i)

    await asyncio.gather(*(worker() for _ in range(c)))
    return out


def count_wrong(contents: list[str], offset: int = 0) -> int:
    return sum(1 for i, c in enumerate(contents) if c != answer_for(messages(offset + i), 1 << 30)[0])


async def run_ours(url: str, n: int, c: int) -> Run:
    async with ServerPool([Endpoint(url, max_concurrency=c)], RetryPolicy(), seed=0) as pool:
        async def call(i: int) -> str:
            return (await pool.chat(messages(i), model=MODEL)).content

        await workers(call, 2 * c, c)  # warm-up: connections open
        t0, c0 = time.perf_counter(), time.process_time()
        contents = await workers(lambda i: call(10_000_000 + i), n, c)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return Run("ours", n, wall, cpu, count_wrong(contents, 10_000_000))


async def run_openai(url: str, n: int, c: int) -> Run:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=2)
    try:
        async def call(i: int) -> str:
            r = await client.chat.completions.create(model=MODEL, messages=messages(i))
            return r.choices[0].message.content or ""

        await workers(call, 2 * c, c)
        t0, c0 = time.perf_counter(), time.process_time()
        contents = await workers(lambda i: call(10_000_000 + i), n, c)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        await client.close()
    return Run("openai", n, wall, cpu, count_wrong(contents, 10_000_000))


async def run_saturation(urls: list[str], slots: int, m: int) -> Run:
    eps = [Endpoint(u, max_concurrency=slots) for u in urls]
    async with ServerPool(eps, RetryPolicy(), seed=0) as pool:
        await asyncio.gather(*(pool.chat(messages(i), model=MODEL) for i in range(slots * len(urls))))  # warm-up
        t0, c0 = time.perf_counter(), time.process_time()
        results = await asyncio.gather(*(pool.chat(messages(20_000_000 + i), model=MODEL) for i in range(m)))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    split = dict(Counter(r.endpoint for r in results))
    return Run(f"ours x{len(urls)}", m, wall, cpu, count_wrong([r.content for r in results], 20_000_000), split)


def bounded(coro, timeout_s: float):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


# ---------------------------------------------------------------- reporting


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda cells: "| " + " | ".join(str(c).rjust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), sep, *(line(r) for r in rows)])


def versions() -> str:
    import httpcore
    import openai

    return (f"python {platform.python_version()}, httpx {httpx.__version__}, httpcore {httpcore.__version__}, "
            f"openai {openai.__version__}, {os.cpu_count()} CPUs")


def load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=2000, help="N, client-overhead requests per run")
    p.add_argument("--concurrency", type=int, default=32, help="C, client-overhead requests in flight")
    p.add_argument("--rounds", type=int, default=2, help="runs per side, alternating")
    p.add_argument("--latency", type=float, default=0.5, help="L, saturation server latency (s)")
    p.add_argument("--slots", type=int, default=64, help="S, saturation server slots")
    p.add_argument("--sat-requests", type=int, default=0,
                   help="M per endpoint in the saturation runs (default 40*S: whole rounds, so the ideal is reachable)")
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    p.add_argument("--timeout", type=float, default=600.0, help="limit per run (s)")
    a = p.parse_args(argv)
    if a.quick:
        a.requests, a.concurrency, a.sat_requests = 300, 16, 4 * a.slots
    a.sat_requests = a.sat_requests or 40 * a.slots

    print(f"# serving client benchmark ({versions()})")
    print(f"# {load()} at start\n")
    ok = True

    # ------------------------------------------------------------ 1. client overhead
    print(f"## Client overhead: N={a.requests} requests, C={a.concurrency} in flight, server latency 0, "
          f"{a.rounds} runs per side alternating\n")
    server = Server()
    runs: list[Run] = []
    try:
        for _ in range(a.rounds):
            runs.append(bounded(run_ours(server.url, a.requests, a.concurrency), a.timeout))
            runs.append(bounded(run_openai(server.url, a.requests, a.concurrency), a.timeout))
    finally:
        server.stop()
    rows = [[str(i // 2 + 1), r.side, f"{r.rps:,.0f}", f"{r.cpu_ms:.3f}", str(r.wrong)] for i, r in enumerate(runs)]
    print(table(["round", "client", "requests/s", "client CPU ms/request", "wrong answers"], rows))
    best = {s: max((r for r in runs if r.side == s), key=lambda r: r.rps) for s in ("ours", "openai")}
    mean = {s: (statistics.mean(r.rps for r in runs if r.side == s), statistics.mean(r.cpu_ms for r in runs if r.side == s))
            for s in ("ours", "openai")}
    print("\nSummary (best = the run with the highest requests/s; mean over all runs alongside):\n")
    rows = [[s, f"{best[s].rps:,.0f}", f"{best[s].cpu_ms:.3f}", f"{mean[s][0]:,.0f}", f"{mean[s][1]:.3f}"] for s in best]
    rps_ratio = best["ours"].rps / best["openai"].rps
    cpu_ratio = best["ours"].cpu_ms / best["openai"].cpu_ms
    mean_cpu_ratio = mean["ours"][1] / mean["openai"][1]
    rows.append(["ours/openai", f"{rps_ratio:.2f}x", f"{cpu_ratio:.2f}x",
                 f"{mean['ours'][0] / mean['openai'][0]:.2f}x", f"{mean_cpu_ratio:.2f}x"])
    print(table(["client", "best requests/s", "best CPU ms/request", "mean requests/s", "mean CPU ms/request"], rows))
    wrong = sum(r.wrong for r in runs)
    met = cpu_ratio <= OVERHEAD_TARGET and wrong == 0
    ok &= met
    print(f"\nTarget: ours/openai client CPU per request <= {OVERHEAD_TARGET:.2f} (best runs), no wrong answers: "
          f"{cpu_ratio:.2f}, {wrong} wrong -> {'MET' if met else 'NOT MET'}\n")

    # ------------------------------------------------------------ 2. saturation
    print(f"## Saturation: server latency L={a.latency} s, S={a.slots} slots per server, "
          f"pool max_concurrency=S per endpoint, M={a.sat_requests} requests per endpoint submitted at once\n")
    rows = []
    for n_ep in (1, 2):
        servers = []
        try:
            for _ in range(n_ep):
                servers.append(Server("--latency", str(a.latency), "--slots", str(a.slots)))
            r = bounded(run_saturation([s.url for s in servers], a.slots, a.sat_requests * n_ep), a.timeout)
        finally:
            for s in servers:
                s.stop()
        ideal = n_ep * a.slots / a.latency
        frac = r.rps / ideal
        met = frac >= SAT_TARGET and r.wrong == 0
        ok &= met
        split = "/".join(f"{v / r.requests:.0%}" for v in sorted(r.split.values(), reverse=True)) if n_ep > 1 else "-"
        rows.append([str(n_ep), str(n_ep * a.slots), str(r.requests), f"{r.wall_s:.2f}", f"{r.rps:,.0f}", f"{ideal:,.0f}",
                     f"{frac:.3f}", f"{r.cpu_ms:.3f}", f"{1000 / r.cpu_ms:,.0f}", split, str(r.wrong),
                     "MET" if met else "NOT MET"])
    print(table(["endpoints", "slots", "requests", "wall s", "requests/s", "ideal E*S/L", "achieved/ideal",
                 "client CPU ms/req", "CPU-bound ceiling req/s", "split", "wrong", f"target >= {SAT_TARGET}"], rows))
    print(f"\n# {load()} at end")
    print(f"# targets: {'all met' if ok else 'NOT all met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
