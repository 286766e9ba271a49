"""What the portable llama.cpp build costs: the same pinned source built portable (our flags) and
native (`-march=native`, what a user might otherwise build), measured side by side on this CPU.

Builds llama.cpp's own `llama-bench` twice from the sdist the project pins (serving/llamacpp/build.py,
cached by source hash and flags), then runs both on the embedded target's GGUF (SmolLM2-135M,
Q4_1), alternating, `--repeat` times each: prompt processing (pp, `-p` tokens) and token generation
(tg, `-n` tokens) at the machine's thread count. Reports tok/s and portable / native per test.

Only meaningful where a native build runs: on a CPU with AVX-512 or AMX the native build uses
them and the ratio says what the portable one gives up; on an AVX2-only CPU both builds use the
same instructions and the ratio should be about 1.

Run: .venv/bin/python -m benchmarks.portable_build [--repeat 3] [--pp 128] [--tg 64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path


from benchmarks.report import cpu_name, load, table
from serving.llamacpp.build import NATIVE_CMAKE_ARGS, PORTABLE_CMAKE_ARGS, build_tool
from tasks.model.target import smollm2_gguf_path, this_cpu_flags


def cpu_flags() -> str:
    have = this_cpu_flags()  # the project's reader of /proc/cpuinfo (tasks/model/target.py)
    if not have:
        return "?"
    return ", ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "avx_vnni", "amx_tile") if f in have)


def bench_once(binary: Path, gguf: Path, pp: int, tg: int, threads: int) -> dict[str, float]:
    out = subprocess.run([str(binary), "-m", str(gguf), "-p", str(pp), "-n", str(tg), "-t", str(threads),
                          "-r", "1", "-o", "json"], capture_output=True, text=True, check=True, timeout=600)
    rows = json.loads(out.stdout)
    result = {}
    for r in rows:
        name = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"
        result[name] = float(r["avg_ts"])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--pp", type=int, default=128)
    ap.add_argument("--tg", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args()

    started = time.monotonic()
    binaries = {}
    for name, flags in (("portable", PORTABLE_CMAKE_ARGS), ("native", NATIVE_CMAKE_ARGS)):
        t0 = time.monotonic()
        binaries[name] = build_tool("llama-bench", flags)
        print(f"{name}: {binaries[name]} ({time.monotonic() - t0:.0f} s, cached after the first build)", flush=True)
    gguf = smollm2_gguf_path()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in binaries}
    load_before = load()
    for _ in range(args.repeat):  # alternate, so drift in the machine's load hits both alike
        for name, binary in binaries.items():
            runs[name].append(bench_once(binary, gguf, args.pp, args.tg, args.threads))
    tests = list(runs["portable"][0])
    rows = []
    for test in tests:
        best = {name: max(r[test] for r in runs[name]) for name in runs}
        rows.append([test, f"{best['portable']:.1f}", f"{best['native']:.1f}", f"{best['portable'] / best['native']:.2f}x"])
    table(f"llama.cpp portable vs native build ({cpu_name()}; {cpu_flags()}; {args.threads} threads; "
          f"SmolLM2-135M Q4_1; best of {args.repeat}; load {load_before} -> {load()}; "
          f"{time.monotonic() - started:.0f} s)",
          ["test", "portable tok/s", "native tok/s", "portable / native"], rows)


if __name__ == "__main__":
    main()
