"""Regeneration: the target's own answers to every prompt, each generated exactly once.

Owns generation identity, the conversation walk for modes `last` and `all`, reasoning handling,
flags, and the async fan-out over a server pool. Promises:
- A generation's id hashes the prompt id and `params_key` (recipes in tasks/ids.py) (target model and revision, chat
  template, mode, reasoning handling, sampling parameters), so resume is by id, never by count.
- Every prompt handed to `regenerate_all` ends as exactly one generation, one failure (with
  the reason and the attempt count) or one deferral (no server answered its last attempt: it
  stays pending for the next run); nothing is dropped. An outage of every endpoint
  (`EndpointsDown`) or a dead embedded server stops the whole call instead: what was written stays
  written, the rest stays pending.
- Empty completions and (if asked) `finish_reason=length` are flagged, never silently kept.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from pathlib import Path

from serving.client import ChatResult, RequestFailed, ServerPool
from storage.datasets import write_generation_file
from storage.lineage import LineageStore
from tasks.config import ImportConfig, RegenerateConfig
from tasks.discover.decontaminate import build_index
from tasks.discover.outcomes import decide_outcomes
from tasks.discover.prompts import Prompt, normalise_record
from tasks.discover.sources import RawRecord, read_file
from tasks.ids import generation_id, generation_params_key


@dataclass(frozen=True)
class GenerationSpec:
    """Everything that identifies how generations are made; recorded with each one."""

    params_key: str
    target_model: str
    target_revision: str
    template_id: str
    mode: str
    reasoning: str
    sampling_json: str
    flag_length: bool

    @classmethod
    def from_config(cls, cfg: RegenerateConfig, template_id: str) -> "GenerationSpec":
        return cls(
            params_key=generation_params_key(cfg, template_id),
            target_model=cfg.target_model,
            target_revision=cfg.target_revision,
            template_id=template_id,
            mode=cfg.mode,
            reasoning=cfg.reasoning,
            sampling_json=json.dumps(cfg.sampling.model_dump(mode="json"), sort_keys=True),
            flag_length=cfg.flag_length,
        )


def request_params(cfg: RegenerateConfig) -> dict:
    params = cfg.sampling.request_params()
    if cfg.reasoning == "disable":
        params["chat_template_kwargs"] = {"enable_thinking": False}
    return params


def _turn_record(index: int, r: ChatResult) -> dict:
    return {
        "turn_index": index,
        "finish_reason": r.finish_reason,
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "prompt_token_ids": r.prompt_token_ids,
        "completion_token_ids": r.completion_token_ids,
        "latency_s": r.latency_s,
        "endpoint": r.endpoint,
        "served_model": r.served_model,
        "attempts": r.attempts,
        "server_build": r.server_build,
    }


async def regenerate_conversation(pool: ServerPool, messages: list[dict], cfg: RegenerateConfig) -> tuple[list[dict], list[dict]]:
    """The conversation with target-written assistant turns, and one record per request.

    `last`: the prompt as stored (original earlier answers as context), one new final answer.
    `all`: walk the turns; every answer is the target's, conditioned on its own earlier answers.
    """
    params = request_params(cfg)
    turns: list[dict] = []

    async def answer(ctx: list[dict]) -> dict:
        sent = [{"role": m["role"], "content": m["content"]} for m in ctx]
        r = await pool.chat(sent, model=cfg.served_model, **params)
        turns.append(_turn_record(len(turns), r))
        reasoning = r.reasoning_content if cfg.reasoning == "save" else None
        return {"role": "assistant", "content": r.content, "reasoning_content": reasoning}

    if cfg.mode == "last":
        out = [dict(m, reasoning_content=None) for m in messages]
        out.append(await answer(messages))
        return out, turns
    context: list[dict] = []
    out = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            continue  # the original answer; the target writes its own below
        context.append({"role": m["role"], "content": m["content"]})
        out.append(dict(m, reasoning_content=None))
        nxt = messages[i + 1]["role"] if i + 1 < len(messages) else None
        if m["role"] == "user" and nxt != "user":
            reply = await answer(context)
            context.append({"role": "assistant", "content": reply["content"]})
            out.append(reply)
    return out, turns


def flags_for(messages: list[dict], turns: list[dict], flag_length: bool) -> list[str]:
    flags = []
    if any(m["role"] == "assistant" and not m["content"].strip() for m in messages):
        flags.append("empty")
    if flag_length and any(t["finish_reason"] == "length" for t in turns):
        flags.append("length")
    return flags


def generation_row(spec: GenerationSpec, prompt_id: str, messages: list[dict], turns: list[dict], origin: str,
                   input_ids: list[int] | None = None, loss_mask: list[int] | None = None) -> dict:
    """One generation as stored in the Parquet files (content) — lineage rows are derived from it."""
    return {
        "generation_id": generation_id(prompt_id, spec.params_key),
        "prompt_id": prompt_id,
        "params_key": spec.params_key,
        "target_model": spec.target_model,
        "target_revision": spec.target_revision,
        "template_id": spec.template_id,
        "mode": spec.mode,
        "reasoning": spec.reasoning,
        "sampling": spec.sampling_json,
        "origin": origin,
        "messages": messages,
        "turns": turns,
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "flags": flags_for(messages, turns, spec.flag_length),
    }


def lineage_row(g: dict, file: str) -> dict:
    turns = g["turns"]

    def total(key: str) -> int | None:
        vals = [t[key] for t in turns if t.get(key) is not None]
        return sum(vals) if vals else None

    completion = total("completion_tokens")
    if completion is None and g["loss_mask"]:
        completion = sum(g["loss_mask"])  # imported: the answer tokens are the loss-masked ones
    return {
        "generation_id": g["generation_id"],
        "prompt_id": g["prompt_id"],
        "params_key": g["params_key"],
        "target_model": g["target_model"],
        "target_revision": g["target_revision"],
        "template_id": g["template_id"],
        "mode": g["mode"],
        "reasoning": g["reasoning"],
        "origin": g["origin"],
        "file": file,
        "n_turns": sum(1 for m in g["messages"] if m["role"] == "assistant"),
        "prompt_tokens": total("prompt_tokens"),
        "completion_tokens": completion,
        "finish_reasons": [t["finish_reason"] for t in turns],
        "flags": g["flags"],
        "has_token_ids": bool(g["input_ids"]) or (bool(turns) and all(t.get("completion_token_ids") for t in turns)),
        "latency_s": total("latency_s"),
        "endpoint": turns[-1]["endpoint"] if turns else None,
        "served_model": turns[-1]["served_model"] if turns else None,
        "server_build": turns[-1].get("server_build") if turns else None,
    }


@dataclass
class Outcome:
    generation: dict | None = None
    failure: dict | None = None
    deferral: dict | None = None  # the failure fields, for a request no server answered


BatchWriter = Callable[[list[dict], list[dict], list[dict]], None]


async def regenerate_all(
    pool: ServerPool,
    pending: list[tuple[str, list[dict]]],
    cfg: RegenerateConfig,
    spec: GenerationSpec,
    write_batch: BatchWriter,
    concurrency: int,
    on_progress: Callable[[int, int], Awaitable[None] | None] | None = None,
) -> tuple[int, int, int]:
    """Generate for every pending prompt; hand finished work to `write_batch` in batches.

    `write_batch(generations, failures, deferrals)` runs in a worker thread, one batch at a time,
    in the order batches fill; only what it has written counts as done. Returns (generated,
    failed, deferred).
    """
    queue: asyncio.Queue = asyncio.Queue()
    todo = iter(pending)  # shared by the workers: each prompt is taken exactly once
    done_gen = done_fail = done_defer = 0

    async def worker() -> None:
        for prompt_id, messages in todo:
            try:
                out, turns = await regenerate_conversation(pool, messages, cfg)
                await queue.put(Outcome(generation=generation_row(spec, prompt_id, out, turns, "server")))
            except RequestFailed as e:
                row = {"generation_id": generation_id(prompt_id, spec.params_key), "prompt_id": prompt_id,
                       "params_key": spec.params_key, "reason": e.reason, "attempts": e.attempts}
                await queue.put(Outcome(deferral=row) if e.unreachable else Outcome(failure=row))

    async def writer() -> None:
        nonlocal done_gen, done_fail, done_defer
        gens: list[dict] = []
        fails: list[dict] = []
        defers: list[dict] = []
        last_flush = time.monotonic()
        finished = 0
        while finished < len(pending):
            try:
                item = await asyncio.wait_for(queue.get(), timeout=5.0)
            except asyncio.TimeoutError:
                item = None
            if item is not None:
                finished += 1
                if item.generation:
                    gens.append(item.generation)
                else:
                    (fails.append(item.failure) if item.failure else defers.append(item.deferral))
            # Flush on size, on time (slow servers still make progress durable), and at the end.
            n = len(gens) + len(fails) + len(defers)
            due = n >= cfg.write_batch or time.monotonic() - last_flush > 30 or finished == len(pending)
            if due and n:
                await asyncio.to_thread(write_batch, gens, fails, defers)
                done_gen += len(gens)
                done_fail += len(fails)
                done_defer += len(defers)
                gens, fails, defers = [], [], []
                last_flush = time.monotonic()
                if on_progress is not None:
                    res = on_progress(done_gen, done_fail)
                    if asyncio.iscoroutine(res):
                        await res

    writer_task = asyncio.create_task(writer())
    workers = [asyncio.create_task(worker()) for _ in range(max(1, min(concurrency, len(pending))))]
    try:
        await asyncio.gather(*workers)
        await writer_task
    except BaseException:
        for t in workers:
            t.cancel()
        writer_task.cancel()
        raise
    return done_gen, done_fail, done_defer


def imported_generations(records: list[RawRecord], outcome_rows: list[dict], spec: GenerationSpec, have: set[str],
                         heldout: set[str] = frozenset()) -> list[dict]:
    """Generation rows for imported conversations the target already wrote.

    Only records discover kept or found to be exact duplicates qualify (contaminated and near
    duplicates do not), never an exact duplicate of a held-out prompt (`heldout`: held-out prompt
    ids), only conversations that end with an answer, and one per prompt that has no generation
    yet (`have`: generation ids already stored).
    """
    out = []
    seen = set(have)
    for rec, row in zip(records, outcome_rows):
        if row["outcome"] not in ("kept", "exact_duplicate") or row["duplicate_of"] in heldout:
            continue
        full = normalise_record(rec.data, keep_final_answer=True)
        if not isinstance(full, Prompt) or full.messages[-1]["role"] != "assistant":
            continue
        gid = generation_id(full.prompt_id, spec.params_key)
        if gid in seen:
            continue
        seen.add(gid)
        ids, mask = rec.data.get("input_ids"), rec.data.get("loss_mask")
        messages = [dict(m, reasoning_content=None) for m in full.messages]
        out.append(generation_row(spec, full.prompt_id, messages, [], "import",
                                  list(ids) if ids else None, list(mask) if mask else None))
    return out


class GenerationWriter:
    """Makes batches durable: the Parquet file first, then its lineage in one transaction.

    A crash between the two leaves a file the lineage store does not know; the next run deletes
    it (storage.datasets.remove_unregistered) and those prompts are simply pending again.
    """

    def __init__(self, store: LineageStore, spec: GenerationSpec, run_id: str, folder: Path):
        self.store, self.spec, self.run_id, self.folder = store, spec, run_id, folder
        self.files = 0

    def write(self, gens: list[dict], fails: list[dict], name: str | None = None, discover_batch=None,
              deferrals: list[dict] = ()) -> int:
        """Write one batch; returns its completion tokens."""
        file_row, rows = None, []
        if gens:
            self.files += 1
            name = name or f"part-{self.run_id[:12]}-{self.files:05d}.parquet"
            size, digest = write_generation_file(gens, self.folder / name)
            file_row = {"file": name, "params_key": self.spec.params_key, "rows": len(gens), "bytes": size, "sha256": digest}
            rows = [lineage_row(g, name) for g in gens]
        self.store.generations.write(self.run_id, file_row, rows, fails, discover_batch, deferrals)
        return sum(r["completion_tokens"] or 0 for r in rows)


def import_finished_generations(imp: ImportConfig, index: int, writer: GenerationWriter) -> tuple[int, int, str | None]:
    """One import source: records through discover's checks, then finished generations, committed together.

    Returns (new records, generations imported, where reading stopped early or None).
    """
    store, spec = writer.store, writer.spec
    source = f"import:{imp.name}"
    records, report = read_file(Path(imp.path), source)
    seen = store.discover.seen_record_keys(source)
    records = [r for r in records if r.record_key not in seen]
    if not records:
        return 0, 0, report.stop_reason
    batch = decide_outcomes(records, {source: ("auto", "prompt", "response")}, store, imp.near_dedupe,
                            build_index(imp.decontaminate))
    heldout = store.discover.heldout_among(sorted({r["duplicate_of"] for r in batch.records if r["duplicate_of"]}))
    candidates = imported_generations(records, batch.records, spec, set(), heldout)
    have = store.generations.existing_ids([g["generation_id"] for g in candidates])
    gens = [g for g in candidates if g["generation_id"] not in have]
    writer.write(gens, [], name=f"import-{index}-{imp.name}-{writer.run_id[:12]}.parquet",
                 discover_batch=(batch.records, batch.prompts, batch.minhash))
    return len(records), len(gens), report.stop_reason
