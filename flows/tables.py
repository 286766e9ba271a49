"""How the `eagle3` command line prints: the row views a person reads first, and tables fit for a terminal or a log.

Owns `OutputFormat`, the two consoles (`console` for results on stdout, `err` for the one-line
errors on stderr), `print_rows` and the views of the benchmark's and the store's rows.

Promises:
- csv and json print every column, one parsable table; `table` prints the columns a reader needs
  first (the full rows stay in csv/json and the Prefect artifacts).
- In a terminal a table fits its width: one column takes what is left and wraps, the others keep
  their width (up to 40).
- In a log or a pipe (stdout not a terminal) no value is wrapped over lines: the console is wider
  than any table or line it prints, so every row is one line and every name appears whole.
"""

from __future__ import annotations

import csv
import json
import sys
from enum import Enum
from typing import TextIO

from rich import box
from rich.console import Console
from rich.table import Table

# A log has no width to fit: wider than any table's natural width, so nothing folds (a table
# without a ratio column takes its natural width, not this one).
LOG_WIDTH = 100_000


class OutputFormat(str, Enum):
    table = "table"
    csv = "csv"
    json = "json"


def is_a_terminal(stream: TextIO) -> bool:
    """Whether `stream` is a terminal a person reads. Not rich's `is_terminal`, which FORCE_COLOR (set by
    many CI systems for coloured logs) turns on in a pipe: colours are welcome in a log, wrapping is not."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def make_console(stderr: bool = False) -> Console:
    """A console that fits a terminal's width, or, writing to a log or a pipe, wraps nothing."""
    if is_a_terminal(sys.stderr if stderr else sys.stdout):
        return Console(stderr=stderr)
    return Console(stderr=stderr, width=LOG_WIDTH)


# Decided once, when the command starts: where its output goes does not change while it runs.
IN_TERMINAL = is_a_terminal(sys.stdout)
console = make_console()
err = make_console(stderr=True)


def print_rows(cols: list[str], rows: list[tuple], fmt: OutputFormat, title: str | None = None,
               wrap: int | None = None) -> None:
    """Print rows as csv, json, or a table with light borders (`wrap`: the column that wraps in a terminal)."""
    if fmt is OutputFormat.csv:
        w = csv.writer(sys.stdout)
        w.writerow(cols)
        w.writerows(rows)
    elif fmt is OutputFormat.json:
        print(json.dumps([dict(zip(cols, r)) for r in rows], default=str, ensure_ascii=False, indent=1))
    elif IN_TERMINAL:
        console.print(rows_table(cols, rows, title, wrap))
    else:
        # A log: the title on a line of its own (a table wraps its title to the table's width).
        if title is not None:
            console.print(title, highlight=False, soft_wrap=True)
        console.print(rows_table(cols, rows, fit=False))


def rows_table(cols: list[str], rows: list[tuple], title: str | None = None, wrap: int | None = None,
               fit: bool = True) -> Table:
    """The rich table of `rows`. `fit` (a terminal): a cell too wide for its column wraps onto the next
    line instead of being cut to `dra…`; one column (`wrap`, else the widest) takes what is left and
    wraps, the others keep their width (up to 40). Not `fit` (a log): no column wraps."""
    cells = [["" if v is None else str(v) for v in r] for r in rows]
    t = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, title_justify="left")
    if not fit:
        for c in cols:
            t.add_column(c, no_wrap=True)
    else:
        widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(cols)]
        wide = (wrap % len(cols) if wrap is not None else widths.index(max(widths))) if widths else 0
        for i, c in enumerate(cols):
            if i == wide:
                t.add_column(c, overflow="fold", ratio=1)
            else:
                t.add_column(c, overflow="fold", no_wrap=widths[i] <= 40, min_width=min(widths[i], 40))
    for r in cells:
        t.add_row(*r)
    return t


def print_dicts(rows: list[dict], title: str) -> None:
    """A flow's summary table (the same rows its Prefect table artifact holds)."""
    print_rows(list(rows[0]), [tuple(r.values()) for r in rows], OutputFormat.table, title)


def acceptance_view(rows: list[dict]) -> tuple[list[str], list[tuple]]:
    """The offline acceptance rows as a person reads them first: who, where, the acceptance length
    (token-weighted), how much was measured, and in one cell the share of verify rounds that
    accepted draft position j, in percent. The full rows (per-request mean, tokens per round,
    rounds) stay in --format csv|json and the Prefect artifact."""
    cols = ["drafter", "domain", "accept", "req", "tokens", "% at pos 1..k"]
    out = []
    for r in rows:
        al = r.get("acceptance_length_token_weighted")
        rates = [r[key] for key in sorted((k for k in r if k.startswith("accept_rate_pos")), key=lambda k: int(k[15:]))]
        out.append((r["drafter"], r["domain"], "-" if al is None else f"{al:.2f}", r["requests"],
                    r["completion_tokens"], " ".join("-" if x is None else f"{100 * x:.0f}" for x in rates)))
    return cols, out


def serving_view(rows: list[dict]) -> tuple[list[str], list[tuple]]:
    """One engine's serving rows (the benchmark's summary rows, or the same read back from the store) as a person
    reads them, in 80 columns: config, concurrency, speed against the baseline, TTFT p50/p90 in ms, acceptance,
    draft tokens accepted / proposed, and how many outputs equal the baseline's (`*`: at concurrency > 1,
    information only). The first divergence, if any, is in the verdict lines under the table."""
    rank = {"baseline": 0, "eagle3": 1}
    cols = ["config", "c", "tok/s", "speedup", "TTFT ms", "accept", "acc/draft", "lossless"]
    out = []
    for r in sorted(rows, key=lambda r: (rank.get(r["drafter"], 2), r.get("k") or 0, r["concurrency"])):
        ttft = "/".join("-" if r.get(k) is None else f"{r[k]:.0f}" for k in ("ttft_p50_ms", "ttft_p90_ms"))
        drafted = r.get("draft_n")
        lossless = "-" if r.get("lossless_total") is None else f"{r['lossless_identical']}/{r['lossless_total']}"
        if r.get("lossless_total") is not None and r.get("lossless_informational"):
            lossless += "*"
        speedup = r.get("speedup_vs_baseline")
        out.append((r["config"], r["concurrency"], f"{r['output_tok_s']:.1f}",
                    "-" if speedup is None else f"{speedup:.2f}x", ttft,
                    "-" if r.get("acceptance") is None else f"{r['acceptance']:.2f}",
                    "-" if drafted is None else f"{r.get('draft_n_accepted') or 0}/{drafted}", lossless))
    return cols, out


def print_serving(rows: list[dict], lines: list[str]) -> None:
    """Each engine's table, then its verdict (faster or slower, break-even, lossless, online vs offline)."""
    from serving.bench.verdict import ENGINE_NAMES, SERVER_NAMES

    for engine in dict.fromkeys(r.get("engine", "llamacpp") for r in rows):
        mine = [r for r in rows if r.get("engine", "llamacpp") == engine]
        build = next((r.get("server_build") for r in mine if r.get("server_build")), "?")
        max_new = mine[0].get("max_new_tokens")
        print_rows(*serving_view(mine), OutputFormat.table,
                   f"{SERVER_NAMES[engine]} {build}, greedy, {max_new} new tokens. TTFT p50/p90; accept = completion "
                   "tokens / target forwards after the prefill (token-weighted); acc/draft = draft tokens "
                   "accepted/proposed; lossless = outputs equal to the baseline's (*: batched, information only)",
                   wrap=0)
        prefix = ENGINE_NAMES[engine] + ": "
        for line in lines:
            if line.startswith(prefix) or not any(line.startswith(n + ": ") for n in ENGINE_NAMES.values()):
                console.print(line, highlight=False, soft_wrap=True)


def serving_lines_from_rows(rows: list[dict]) -> list[str]:
    """The verdict lines of each engine's rows (read back from the store), named by engine as the flow names them."""
    from serving.bench.verdict import ENGINE_NAMES, agreement_line, verdict_lines

    out = []
    for engine in dict.fromkeys(r.get("engine", "llamacpp") for r in rows):
        mine = [r for r in rows if r.get("engine", "llamacpp") == engine]
        agree = [r["offline_agreement"] for r in mine if r.get("offline_agreement")]
        out += [f"{ENGINE_NAMES[engine]}: {line}"
                for line in verdict_lines(mine) + [agreement_line(a, a["k"]) for a in agree]]
    return out


def curve_point_view(rows: list[dict]) -> tuple[str, list[str], list[tuple]]:
    """The latest point of the acceptance curve: what the draft was trained on (the title), then each
    drafter's acceptance length there (prompt lookup and the final-state-only draft are the references)."""
    p = next((r for r in rows if r["drafter"] == "eagle3"), rows[0])
    n = lambda v: "-" if v is None else f"{v:,}"  # noqa: E731
    title = (f"acceptance curve, latest point: {p['checkpoint']} ({n(p['training_tokens'])} training tokens, "
             f"{n(p['training_conversations'])} conversations), {p['domain']}, {p['config_label']}")
    out = [(r["drafter"], "-" if r["acceptance_length"] is None else f"{r['acceptance_length']:.2f}") for r in rows]
    return title, ["drafter", "acceptance length"], out


