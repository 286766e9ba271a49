"""The CLI's tables in a log or a pipe: every row on one line, every name whole (flows/tables.py).

Each case prints from a child process whose stdout is a pipe, as `eagle3 run | tee demo.log` does;
in a terminal (a pseudo-terminal of 60 columns) the same table still fits the terminal's width.
"""

from __future__ import annotations

import contextlib
import json
import os
import pty
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT = "demo-draft/sglang-step-00000080"  # the name the demo's log wrapped over three lines
LONG = "runs/a-rather-long-workspace-name/exports/" + CHECKPOINT + "-speculators-with-a-long-suffix"


def _printed(code: str) -> list[str]:
    """stdout lines of `code` run in a child whose stdout is a pipe (not a terminal)."""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in out.stdout.splitlines()]


def _one_line_each(lines: list[str], rows: list[tuple]) -> None:
    for row in rows:
        first = str(row[0])
        hits = [line for line in lines if first in line]
        assert len(hits) == 1, f"{first!r} is not whole on exactly one line:\n" + "\n".join(lines)
        assert all(str(cell) in hits[0] for cell in row), f"row {row} is not one line:\n" + "\n".join(lines)


def test_rows_with_long_names_print_one_line_each_into_a_pipe():
    rows = [(LONG, 80, "1.52", "x" * 30), ("eagle3-final-state-only", 80, "1.10", "-"), ("prompt-lookup", 0, "-", "-")]
    lines = _printed("import json, sys\nfrom flows.tables import OutputFormat, print_rows\n"
                     f"print_rows(['checkpoint', 'step', 'accept', 'note'], [tuple(r) for r in json.loads({json.dumps(json.dumps(rows))})], "
                     "OutputFormat.table, title='acceptance by checkpoint')")
    _one_line_each(lines, rows)
    assert lines[0] == "acceptance by checkpoint"


def test_the_serving_table_and_the_curve_title_keep_checkpoint_names_whole_in_a_pipe():
    base = {"engine": "llamacpp", "server_build": "b1234", "max_new_tokens": 64, "concurrency": 1, "k": None,
            "output_tok_s": 40.0, "ttft_p50_ms": 20.0, "ttft_p90_ms": 30.0, "speedup_vs_baseline": None,
            "acceptance": None, "draft_n": None, "lossless_total": None}
    serving = [{**base, "drafter": "baseline", "config": "baseline"},
               {**base, "drafter": "eagle3", "k": 4, "config": f"eagle3 {CHECKPOINT} k=4", "output_tok_s": 52.5,
                "speedup_vs_baseline": 1.31, "acceptance": 2.4, "draft_n": 100, "draft_n_accepted": 60,
                "lossless_total": 8, "lossless_identical": 8, "lossless_informational": False}]
    curve = [{"drafter": "eagle3", "checkpoint": LONG, "training_tokens": 81920, "training_conversations": 120,
              "domain": "heldout-chat", "config_label": "llamacpp k=4", "acceptance_length": 1.8},
             {"drafter": "prompt-lookup", "checkpoint": LONG, "training_tokens": 81920, "training_conversations": 120,
              "domain": "heldout-chat", "config_label": "llamacpp k=4", "acceptance_length": 1.2}]
    lines = _printed("import json\nfrom flows.tables import OutputFormat, curve_point_view, print_rows, print_serving\n"
                     f"print_serving(json.loads({json.dumps(json.dumps(serving))}), ['llama.cpp: faster'])\n"
                     f"title, cols, rows = curve_point_view(json.loads({json.dumps(json.dumps(curve))}))\n"
                     "print_rows(cols, rows, OutputFormat.table, title=title)")
    _one_line_each(lines, [(f"eagle3 {CHECKPOINT} k=4", "52.5", "1.31x", "2.40", "60/100", "8/8"),
                           ("prompt-lookup", "1.20")])
    assert [line for line in lines if LONG in line] == [
        f"acceptance curve, latest point: {LONG} (81,920 training tokens, 120 conversations), heldout-chat, llamacpp k=4"]


def test_a_terminal_still_gets_a_table_that_fits_its_width():
    """In a terminal (a pseudo-terminal of 60 columns) the long name folds inside its column instead."""
    master, slave = pty.openpty()
    code = ("from flows.tables import OutputFormat, print_rows\n"
            f"print_rows(['checkpoint', 'step', 'accept'], [({LONG!r}, 80, '1.52')], OutputFormat.table)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, stdout=slave, stderr=subprocess.PIPE, text=True,
                          timeout=120, env={**os.environ, "COLUMNS": "60", "NO_COLOR": "1"})
    os.close(slave)
    chunks = []
    with contextlib.suppress(OSError):  # EIO once the child's output is read to its end
        while chunk := os.read(master, 4096):
            chunks.append(chunk)
    os.close(master)
    assert proc.returncode == 0, proc.stderr
    lines = [re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", line) for line in b"".join(chunks).decode().splitlines()]
    assert lines and max(len(line) for line in lines) <= 60, "\n".join(lines)
    rule = next(i for i, line in enumerate(lines) if "\u2500" in line)
    assert "".join(line.split()[0] for line in lines[rule + 1:] if line.strip()) == LONG  # folded, not cut
