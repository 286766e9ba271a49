"""Regenerate throughput of the embedded server: llama.cpp's `llama-server` with parallel slots (the
embedded server now) against llama-cpp-python's Python server (the embedded server before), in one run.

Both serve the same GGUF (SmolLM2-135M Q4_1, the embedded target) from the same pinned llama.cpp
source, built with the same portable flags. The same ShareGPT first-turn prompts are answered
greedily (temperature 0, repeat_penalty 1.0) with the same max_tokens by the client regenerate
uses (`serving.client.ServerPool`), keeping as many requests in flight as the server has slots:
- `llama-cpp-python`: one slot, OpenAI chat API (what regenerate sent before);
- `llama-server -np 1` and `-np N`: the token-exact path (template and tokenizer on the server,
  prompt ids in, sampled ids out), N requests in flight.
Reports aggregate completion tokens/s (all requests, wall clock from first send to last answer),
the ratio against the old server, and whether the greedy answers are the same text.

Run: .venv/bin/python -m benchmarks.embedded_server [--prompts 24] [--max-tokens 128] [--parallel 2 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path


from benchmarks.report import load, table
from serving.client import Endpoint, ServerPool
from serving.llamacpp.server import LlamaCppServer
from tasks.discover.sources import sharegpt_package_path
from tasks.model.target import smollm2_gguf_path


def sharegpt_prompts(n: int, skip: int = 0) -> list[str]:
    """The first `n` English-looking first human turns of the packaged ShareGPT file, 20-600 chars."""
    from tasks.discover.sources import read_file

    records, _ = read_file(sharegpt_package_path(), "sharegpt", "bench")
    out = []
    for r in records:
        turns = (r.data or {}).get("conversations") or []
        text = turns[0].get("value", "") if turns and turns[0].get("from") == "human" else ""
        if 20 <= len(text) <= 600 and text.isascii():
            out.append(text)
        if len(out) == n + skip:
            break
    return out[skip:]


async def answer_all(url: str, kind: str, concurrency: int, prompts: list[str], max_tokens: int) -> tuple[float, list]:
    async with ServerPool([Endpoint(url, max_concurrency=concurrency, kind=kind)]) as pool:
        started = time.perf_counter()
        results = await asyncio.gather(*(pool.chat([{"role": "user", "content": p}], temperature=0.0,
                                                    max_tokens=max_tokens, repeat_penalty=1.0) for p in prompts))
        return time.perf_counter() - started, results


def measure(engine: str, parallel: int, prompts: list[str], max_tokens: int, threads: int) -> dict:
    kind = "openai" if engine == "llama-cpp-python" else "llamacpp"
    with LlamaCppServer(smollm2_gguf_path(), engine=engine, parallel=parallel, n_ctx=2048, n_threads=threads) as s:
        asyncio.run(answer_all(s.base_url, kind, 1, prompts[:1], 8))  # warm-up: first-touch of the weights
        wall, results = asyncio.run(answer_all(s.base_url, kind, parallel, prompts, max_tokens))
    tokens = sum(r.completion_tokens for r in results)
    return {"engine": engine, "parallel": parallel, "wall_s": wall, "tokens": tokens, "tok_s": tokens / wall,
            "texts": [r.content for r in results], "with_ids": sum(1 for r in results if r.completion_token_ids)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--parallel", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--json", type=Path, help="also write the measurements here")
    args = ap.parse_args()

    prompts = sharegpt_prompts(args.prompts)
    load_before = load()
    started = time.monotonic()
    runs = [measure("llama-cpp-python", 1, prompts, args.max_tokens, args.threads),
            measure("llama-server", 1, prompts, args.max_tokens, args.threads)]
    runs += [measure("llama-server", n, prompts, args.max_tokens, args.threads) for n in args.parallel]
    old = runs[0]
    rows = []
    for r in runs:
        same = sum(a == b for a, b in zip(r["texts"], old["texts"]))
        rows.append([f"{r['engine']} ({r['parallel']} slot{'s' if r['parallel'] > 1 else ''})", r["tokens"],
                     f"{r['wall_s']:.1f}", f"{r['tok_s']:.1f}", f"{r['tok_s'] / old['tok_s']:.2f}x",
                     f"{same}/{len(prompts)}", f"{r['with_ids']}/{len(prompts)}"])
    table(f"Embedded regenerate server: {len(prompts)} ShareGPT prompts, greedy, max_tokens {args.max_tokens}, "
          f"{args.threads} threads, SmolLM2-135M Q4_1 (load {load_before} -> {load()}; "
          f"{time.monotonic() - started:.0f} s)",
          ["server", "tokens", "wall s", "tok/s", "vs llama-cpp-python", "same text as old", "token ids"], rows)
    if args.json:
        args.json.write_text(json.dumps([{k: v for k, v in r.items() if k != "texts"} for r in runs], indent=2))


if __name__ == "__main__":
    main()
