"""Reading one engine sweep's summary rows: the verdict lines, the mean over interleaved passes, and the agreement
of online acceptance with the offline evaluator's.

Owns what a reader is told about a serving sweep once it has been measured (serving/bench/engines.py measures it;
flows/tables.py reads the same rows back from the store). Promises: every function takes plain rows
(`EngineBenchResult.rows()` or the same fields from the store) and starts no server; a verdict names the fastest
n-gram setting a user would pick and, where the draft is slower, the acceptance it would need at its measured cost
per verify round; a mean over passes matches rows by (config, concurrency), never by position.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from serving.bench.results import needed_accept_length, rounded

ENGINE_NAMES: dict[str, str] = {"llamacpp": "llama.cpp", "vllm": "vLLM"}  # as a reader knows them
SERVER_NAMES: dict[str, str] = {"llamacpp": "llama-server", "vllm": "vLLM"}
BASELINE = "baseline"
AGREEMENT_TOLERANCE = 0.10  # the issue asks online acceptance within 10% of the offline evaluator's
DRIFT_TOLERANCE = 0.15  # the baseline measured first and last may differ this much before speedups are doubted


def verdict_lines(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The verdict from one engine's summary rows (EngineBenchResult.rows(), or the same fields read back from the
    store)."""
    lines = []
    engine = next((r.get("engine") for r in rows if r.get("engine")), "llamacpp")
    first = next((r for r in rows if r.get("drafter") == BASELINE and r["concurrency"] == 1), None)
    again = (first or {}).get("baseline_recheck_tok_s")
    if first is not None and again is not None:
        drift = again / first["output_tok_s"] if first["output_tok_s"] else float("inf")
        if abs(drift - 1) > DRIFT_TOLERANCE:
            lines.append(f"WARNING: the baseline ran at {first['output_tok_s']:.1f} tok/s first and {again:.1f} tok/s "
                         f"when measured again last ({drift:.2f}x): the machine's speed changed during the benchmark, "
                         "so the speedups below are not reliable; rerun it on a quiet machine")
        if first.get("baseline_recheck_identical") is False:
            lines.append(f"WARNING: the baseline's greedy output differed between its two runs: {SERVER_NAMES[engine]} "
                         "is not deterministic here, and the lossless counts mean less")
    eagle = [r for r in rows if r.get("drafter") == "eagle3"]
    drafts = list(dict.fromkeys(draft_of(r["config"]) for r in eagle))  # several when one sweep serves several drafts
    for c in sorted({r["concurrency"] for r in eagle}):
        for draft in drafts:
            at = sorted((r for r in eagle if r["concurrency"] == c and draft_of(r["config"]) == draft),
                        key=lambda r: r.get("k") or 0)
            if not at:
                continue
            needs = ", ".join(f"k={r['k']} needs {_fmt(r.get('accept_needed'))} (measured {_fmt(r.get('acceptance'))})"
                              for r in at)
            best = max(at, key=lambda r: r.get("speedup_vs_baseline") or 0.0)
            speedup = best.get("speedup_vs_baseline")
            if speedup is None:
                lines.append(f"concurrency {c}: break-even acceptance: {needs}.")
                continue
            word = "faster" if speedup > 1 else "slower"
            ngram = [r for r in rows if r.get("drafter") not in ("eagle3", BASELINE) and r["concurrency"] == c
                     and r.get("output_tok_s")]
            versus = ""
            if ngram:  # against the n-gram a user would pick: its fastest setting in this sweep
                fastest = max(ngram, key=lambda r: r["output_tok_s"])
                # "as fast as": a bare "0.82x vLLM's ngram-k3" read as the n-gram's own speedup.
                versus = (f"; {best['output_tok_s'] / fastest['output_tok_s']:.2f}x as fast as {ENGINE_NAMES[engine]}'s "
                          f"{fastest['config']}" + (f" (the fastest of its {len(ngram)} n-gram settings)"
                                                    if len(ngram) > 1 else ""))
                if best["output_tok_s"] < fastest["output_tok_s"] and best.get("acceptance"):
                    # At its measured cost per verify round (tokens per round / tokens per second), the
                    # acceptance at which the draft's best config would serve as fast as the n-gram.
                    needed = best["acceptance"] * fastest["output_tok_s"] / best["output_tok_s"]
                    versus += (f"; to match it {best['config']} needs acceptance {needed:.2f} (measured "
                               f"{best['acceptance']:.2f}, {1 - best['acceptance'] / needed:.0%} short)")
            which = f" ({draft})" if len(drafts) > 1 else ""
            lines.append(f"concurrency {c}: on {ENGINE_NAMES[engine]} the EAGLE-3 draft{which} is {word} than the "
                         f"baseline: best {speedup:.2f}x ({best['config']}){versus}. Break-even acceptance (verify round "
                         f"cost / baseline time per token): {needs}.")
    for r in rows:
        if r.get("drafter") not in ("eagle3", BASELINE) and r.get("speedup_vs_baseline") is not None:
            lines.append(f"concurrency {r['concurrency']}: {ENGINE_NAMES[engine]}'s {r['config']}: "
                         f"{r['speedup_vs_baseline']:.2f}x the baseline, acceptance {_fmt(r.get('acceptance'))}.")
    checks = [r for r in rows if r.get("drafter") != BASELINE and r["concurrency"] == 1 and r.get("lossless")]
    if checks:
        lossy = [r for r in checks if r["lossless_identical"] != r["lossless_total"]]
        lines.append("lossless at concurrency 1 (greedy ids equal to the baseline's): "
                     + ", ".join(f"{r['config']} {r['lossless']}" for r in checks)
                     + ("" if not lossy else "  <- NOT LOSSLESS"))
    return lines


def draft_of(label: str) -> str:
    """Which draft an EAGLE-3 config serves: its label without the k (`eagle3-cosine-k2` -> `eagle3-cosine`)."""
    return re.sub(r"-k\d+$", "", label)


def mean_over_passes(passes: Sequence[Sequence[Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """One row per (config, concurrency) from several passes of the same sweep (EngineBenchResult.rows() each):
    the speeds averaged, the speedup the ratio of the averaged speeds, each pass's speed kept
    (`output_tok_s_by_pass`); a verify round's cost averaged too, and the break-even acceptance recomputed from it
    and the averaged baseline (a table of means must not carry the first pass's break-even); the rest from the first
    pass. Acceptance and outputs are the same in every pass of a greedy, lossless sweep; `lossless_identical` is the
    fewest identical of any pass. Each pass's rows may come in any order (`pass_order`)."""
    if not passes:
        raise ValueError("no passes to average")
    # rows matched by (config, concurrency), in the first pass's order: a later pass may run them in another order
    keys = [[(r["config"], r["concurrency"]) for r in rows] for rows in passes]
    if any(sorted(k) != sorted(keys[0]) or len(set(k)) != len(k) for k in keys):
        raise ValueError("the passes did not measure the same configs at the same concurrencies")
    place = {k: i for i, k in enumerate(keys[0])}
    passes = [sorted(rows, key=lambda r: place[(r["config"], r["concurrency"])]) for rows in passes]
    base = {}
    out = []
    for i, first in enumerate(passes[0]):
        speeds = [rows[i]["output_tok_s"] for rows in passes]
        row = {**first, "output_tok_s": round(sum(speeds) / len(speeds), 2), "output_tok_s_by_pass": speeds,
               "passes": len(passes)}
        if first.get("lossless_identical") is not None:
            row["lossless_identical"] = min(rows[i]["lossless_identical"] for rows in passes)
            row["lossless"] = next(rows[i]["lossless"] for rows in passes
                                   if rows[i]["lossless_identical"] == row["lossless_identical"])
        if first.get("drafter") == BASELINE:
            base[first["concurrency"]] = row["output_tok_s"]
        out.append(row)
    for i, row in enumerate(out):
        ref = base.get(row["concurrency"])
        row["speedup_vs_baseline"] = round(row["output_tok_s"] / ref, 3) if ref else None
        round_ms = [rows[i].get("ms_per_verify_round") for rows in passes]
        if ref and row.get("acceptance") and all(round_ms):
            mean_ms = sum(round_ms) / len(round_ms)
            needed = needed_accept_length(mean_ms / 1000, ref, row["concurrency"])
            row.update(ms_per_verify_round=round(mean_ms, 1), ms_per_verify_round_by_pass=round_ms,
                       accept_needed=rounded(needed), predicted_speedup=rounded(row["acceptance"] / needed))
    return out


# ---------------------------------------------------------------- agreement with the offline evaluator


def agreement(rows: Sequence[Mapping[str, Any]], offline_k: int, offline_acceptance: float | None) -> dict[str, Any] | None:
    """Online (one engine's rows: eagle3 at K = offline_k, concurrency 1) vs offline acceptance on the same prompts.

    Both are completion tokens / target forwards after the prefill. None when the sweep has no such K.
    """
    online = next((r for r in rows if r.get("drafter") == "eagle3" and r.get("k") == offline_k
                   and r["concurrency"] == 1), None)
    if online is None:
        return None
    on = online.get("acceptance")
    ratio = on / offline_acceptance if on is not None and offline_acceptance else None
    return {"k": offline_k, "online": on, "offline": offline_acceptance, "ratio": rounded(ratio),
            "within_tolerance": None if ratio is None else abs(ratio - 1) <= AGREEMENT_TOLERANCE,
            "engine": online.get("engine", "llamacpp")}


def agreement_line(item: dict[str, Any] | None, offline_k: int, note: str = "") -> str:
    """One line for the table's reader; `note` says what differs between the two measurements, if anything."""
    return _agreement_line(item, offline_k) + note


def _agreement_line(item: dict[str, Any] | None, offline_k: int) -> str:
    if item is None:
        return (f"online vs offline acceptance: the serving sweep has no k={offline_k} (the offline evaluator's k); "
                "add it to serving.draft_tokens to compare them")
    if item["ratio"] is None:
        return f"online vs offline acceptance at k={offline_k}: nothing to compare (an acceptance is missing)"
    within = "within" if item["within_tolerance"] else "NOT within"
    server = SERVER_NAMES[item.get("engine", "llamacpp")]
    return (f"online vs offline acceptance at k={offline_k}, same prompts: {server} {item['online']:.3f}, offline "
            f"evaluator {item['offline']:.3f}, ratio {item['ratio']:.3f} ({within} {AGREEMENT_TOLERANCE:.0%})")


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"
