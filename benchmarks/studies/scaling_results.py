"""The scaling study's results (benchmarks/studies/scaling.py): one JSON line per measured (arm, size, chain depth),
appended and fsynced so a crash costs at most the line being written, and the table and plot drawn from them.

Pure functions of the results file: `python -m benchmarks.studies.scaling --report` redraws everything without a model or a
server.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Iterable

MAIN, SCRATCH = "main", "scratch"  # the main arm (one draft, continued) and the from-scratch controls
DOMAINS = ("heldout_chat", "humaneval")


# ---------------------------------------------------------------- the results file

def point_key(arm: str, size: int, k: int) -> str:
    return f"{arm}/{size}/k{k}"


def load_results(path: Path) -> dict[str, dict]:
    """The measured points of a results file, by key; the last line of a key wins, and a line cut
    short by a crash (not valid JSON) is ignored."""
    out: dict[str, dict] = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
            out[point_key(row["arm"], int(row["size"]), int(row["k"]))] = row
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
    return out


def missing_ks(done: dict[str, dict], arm: str, size: int, ks: Iterable[int]) -> list[int]:
    """The chain depths of (arm, size) still to measure."""
    return [k for k in ks if point_key(arm, size, k) not in done]


def append_result(path: Path, row: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(row, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def acceptance_row(report, drafters: dict[str, str]) -> dict:
    """An offline report (tasks.evaluate.offline.OfflineReport) as a results row: for each drafter the report
    has (`drafters`: the row's short name -> the drafter's name) and each domain (and "all"),
    `<short>_<domain>` the token-weighted acceptance, `_pos` by position, `_requests`, and per domain
    `_per_request` {prompt: [completion tokens, verify rounds]} for the bootstrap intervals (`ratio_interval`)."""
    row: dict = {}
    for short, name in drafters.items():
        for dom in DOMAINS + ("all",):
            try:
                a = report.get(name, dom)
            except KeyError:
                continue
            row[f"{short}_{dom}"] = a.acceptance_length_token_weighted
            row[f"{short}_{dom}_pos"] = a.position_accept_rate
            row[f"{short}_{dom}_requests"] = a.requests
            if dom != "all":
                row[f"{short}_{dom}_per_request"] = {r.item_id: [r.completion_tokens, r.verify_rounds]
                                                     for r in report.requests if r.drafter == name and r.domain == dom}
    return row


def ratio_interval(num: dict[str, list[int]] | None, den: dict[str, list[int]] | None, draws: int = 2000,
                   level: float = 0.9, seed: int = 0) -> tuple[float, float] | None:
    """A paired bootstrap interval for one drafter's token-weighted acceptance length over another's, on the
    prompts both decoded: each input maps a prompt's item id to [completion_tokens, verify_rounds] (a point's
    `<drafter>_<domain>_per_request`). Each draw resamples the prompts with replacement, the same prompts for
    both drafters, so the interval holds the variance of the prompt set (32 prompts are few) and not of
    decoding (greedy: none). None when either side is missing or shares fewer than 2 prompts."""
    if not num or not den:
        return None
    items = sorted(set(num) & set(den))
    if len(items) < 2:
        return None
    rng = random.Random(seed)
    ratios = []
    for _ in range(draws):
        pick = [items[rng.randrange(len(items))] for _ in items]
        n_rounds, d_rounds = sum(num[i][1] for i in pick), sum(den[i][1] for i in pick)
        if n_rounds and d_rounds:
            ratios.append((sum(num[i][0] for i in pick) / n_rounds) / (sum(den[i][0] for i in pick) / d_rounds))
    if not ratios:
        return None
    ratios.sort()
    tail = (1 - level) / 2
    return ratios[int(tail * (len(ratios) - 1))], ratios[round((1 - tail) * (len(ratios) - 1))]


# ---------------------------------------------------------------- report

def fmt(x, digits: int = 2) -> str:
    """A number for a table cell: "-" when missing."""
    return "-" if x is None else f"{x:,.{digits}f}"


def _pos(p) -> str:
    return "/".join("-" if v is None else f"{v:.2f}" for v in (p or []))


def markdown_table(rows: list[dict]) -> str:
    head = ["size", "arm", "k", "train tok", "heldout AL", "HE AL", "PL heldout", "PL HE", "final-only heldout",
            "final-only HE", "per-pos heldout", "per-pos HE", "regen tok/s", "extract tok/s", "train tok/s", "wall s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(rows, key=lambda r: (r["size"], r["arm"] != MAIN, r["k"])):
        cells = [f"{r['size']:,}", r["arm"], str(r["k"]), f"{r.get('train_tokens', 0):,}",
                 fmt(r.get("eagle3_heldout_chat")), fmt(r.get("eagle3_humaneval")),
                 fmt(r.get("lookup_heldout_chat")), fmt(r.get("lookup_humaneval")),
                 fmt(r.get("final_heldout_chat")), fmt(r.get("final_humaneval")),
                 _pos(r.get("eagle3_heldout_chat_pos")), _pos(r.get("eagle3_humaneval_pos")),
                 fmt(r.get("regen_tok_s"), 0), fmt(r.get("extract_tok_s"), 0), fmt(r.get("train_tok_s"), 0),
                 fmt(r.get("wall_s"), 0)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ablation_table(rows: list[dict]) -> str:
    """Each ablation arm against the plain from-scratch control of its size and k: the change, acceptance and
    its difference, and the training speed (the cost side of a recipe change)."""
    plain = {(r["size"], r["k"]): r for r in rows if r["arm"] == SCRATCH}
    arms = sorted((r for r in rows if r["arm"].startswith(SCRATCH + " ") and (r["size"], r["k"]) in plain),
                  key=lambda r: (r["size"], r["k"], r["arm"]))
    if not arms:
        return ""

    def delta(r: dict, key: str) -> str:
        a, b = r.get(key), plain[(r["size"], r["k"])].get(key)
        return "-" if a is None or b is None else f"{a - b:+.2f}"

    head = ["size", "k", "change", "heldout AL", "vs control", "HE AL", "vs control", "per-pos heldout",
            "train tok/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in [plain[key] for key in sorted({(a["size"], a["k"]) for a in arms})] + arms:
        change = r["arm"][len(SCRATCH) + 1:] or "(control)"
        lines.append("| " + " | ".join([
            f"{r['size']:,}", str(r["k"]), change, fmt(r.get("eagle3_heldout_chat")), delta(r, "eagle3_heldout_chat"),
            fmt(r.get("eagle3_humaneval")), delta(r, "eagle3_humaneval"), _pos(r.get("eagle3_heldout_chat_pos")),
            fmt(r.get("train_tok_s"), 0)]) + " |")
    return "\n".join(lines)


def recipe_arms(rows: list[dict]) -> list[str]:
    """Ablation arms measured at two sizes or more: a recipe's own curve, plotted beside the main arm's
    (an arm measured at one size stays in the ablation table only)."""
    sizes_of: dict[str, set[int]] = {}
    for r in rows:
        sizes_of.setdefault(r["arm"], set()).add(r["size"])
    return sorted(a for a, sizes in sizes_of.items() if a not in (MAIN, SCRATCH) and len(sizes) > 1)


def plot(rows: list[dict], path: Path, k: int = 3) -> Path | None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    at_k = [r for r in rows if r["k"] == k]
    if not at_k:
        return None
    fig, ax = plt.subplots(figsize=(12, 5))
    colors = {"heldout_chat": "tab:blue", "humaneval": "tab:orange"}
    recipes = recipe_arms(at_k)
    plotted: set[int] = set()
    for dom in DOMAINS:
        for arm, style in ((MAIN, "-o"), (SCRATCH, "s"), *((a, "--^") for a in recipes)):
            pts = sorted((r["train_tokens"], r.get(f"eagle3_{dom}")) for r in at_k
                         if r["arm"] == arm and r.get(f"eagle3_{dom}") is not None)
            if pts:
                plotted.update(x for x, _ in pts)
                label = {MAIN: f"EAGLE-3 {arm} ({dom})", SCRATCH: f"from scratch ({dom})"}.get(
                    arm, f"{arm.replace(SCRATCH, 'from scratch,', 1)} ({dom})")
                ax.plot(*zip(*pts), style, color=colors[dom], markersize=8 if arm == SCRATCH else 5, label=label)
        final = sorted((r["train_tokens"], r.get(f"final_{dom}")) for r in at_k
                       if r["arm"] == MAIN and r.get(f"final_{dom}") is not None)
        if final:
            ax.plot(*zip(*final), ":", color=colors[dom], alpha=0.6, label=f"final state only ({dom})")
        lookup = [r.get(f"lookup_{dom}") for r in at_k if r.get(f"lookup_{dom}") is not None]
        if lookup:
            ax.axhline(lookup[-1], color=colors[dom], linestyle="--", alpha=0.8, label=f"prompt lookup ({dom})")
    ax.set_xscale("log", base=2)
    ticks = sorted(plotted)
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xticks(ticks, [f"{t / 1000:,.1f}K" if t < 100_000 else f"{t / 1000:,.0f}K" for t in ticks])
    ax.set_xlabel("training tokens (loss-masked, target-written)")
    ax.set_ylabel(f"acceptance length (chain depth k={k}, greedy)")
    ax.set_title("EAGLE-3 draft for SmolLM2-135M-Instruct: acceptance vs training data")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the plot: no point hidden
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(results: Path, k_plot: int = 3) -> str:
    rows = list(load_results(results).values())
    table = markdown_table(rows)
    some = rows[0] if rows else {}
    text = (f"# Scaling study ({results.parent.parent})\n\nAcceptance length (token-weighted, greedy, chain depth k) of "
            f"the draft on {some.get('prompts_per_domain', '?')} held-out chat and HumanEval prompts each, "
            f"{some.get('max_new_tokens', '?')} new tokens; PL = prompt lookup, final-only = the same draft fed only "
            "the final state; per-pos = acceptance rate at each draft position (EAGLE-3); train tok = loss-masked "
            "tokens of the samples trained on; regen tok/s = completion tokens/s, extract tok/s = all prefilled "
            "tokens/s, train tok/s = loss-masked positions/s (epochs counted).\n\n" + table + "\n")
    ablations = ablation_table(rows)
    if ablations:
        text += "\n## Ablations (one change each against the from-scratch control)\n\n" + ablations + "\n"
        table += "\n\n" + ablations
    (results.parent / "scaling.md").write_text(text)
    plot(rows, results.parent / "scaling.png", k_plot)
    return table
