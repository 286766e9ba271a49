"""The scaling study on the embedded target (issue 14): acceptance against training tokens.

Each point is a number of training tokens N (loss-masked, target-written tokens: `samples.masked_tokens`,
the positions the draft is trained to predict), doubling from 25K (`--sizes`, `--max-size`).

Main arm (the pipeline's own design): one draft (`train.run_name` of the config) continued round after
round. For each N, in order: regenerate in chunks (`limit`) until the workspace's generations (never
held-out prompts) hold N loss-masked tokens (each generation tokenised as extraction will tokenise it);
take the first generations in the order extraction takes them (created_at, generation_id) whose
loss-masked tokens reach N; extract only those not yet extracted
(`limit`: the round holds the new data); train (the same run continues from its checkpoint, `epochs`
passes over the new round); then measure the round's SGLang export. Regenerated data is kept: a rerun
regenerates nothing that exists. If the disk budget stops an extraction early, the point takes more
than one extract -> train round.

From-scratch controls (`--controls`, default 50K and 200K): a fresh draft (run `<run_name>-scratch-N`)
trained from its initialisation on exactly the main arm's data up to N, for the same `epochs` passes
over every token (the main arm passes `epochs` times over each round's new data). `train.mode: online`
cannot be restricted to the first N tokens' generations (it trains on every generation of the
workspace), and the main arm's shards are consumed and deleted after its rounds, so each control gets
its own workspace, `<workspace>/controls/scratch-N`, filled by the pipeline's own import
(`regenerate.imports`): the same generations' conversations with their stored token ids and loss
masks (tokenised as the main extraction tokenises them), then extract and train there as usual. One
difference remains and is by design: the control's draft vocabulary is built from all of its data,
the main arm's from its first round (the pipeline keeps the first vocab built so later rounds keep
the same draft ids).

Ablations (`--ablate`, at `--ablate-size`, default 50K): the from-scratch control with one change each
(`train.epochs=4`, `extract.draft_vocab_size=16384`, `data.loss_on=all`, or several joined by commas), each
in its own workspace `<workspace>/controls/scratch-N-<change>`; the report compares each with the control.

Measurement (every arm and size alike): offline acceptance (tasks/evaluate/offline.py, the benchmark flow's
measuring: greedy chain of depth k, lossless-checked) of the export, loaded through the serving
contract check, on the main workspace's held-out chat prompts (`heldout_chat`) and HumanEval, at each
k of `--ks` (default 3 4), with both baselines (prompt lookup, the same draft fed only the final
state) and acceptance by draft position. The target's greedy decodings are computed once per process
and shared by every point and k.

Resumable: one JSON line per (arm, size, k) is appended to `<workspace>/reports/scaling.jsonl`; a
rerun skips points already measured (the flows themselves are crash-safe, so a point interrupted
anywhere is simply redone from where its stages stopped). Costs per point: regenerate tok/s (this
point's regenerate runs, else the workspace's regenerate runs from lineage), extract tok/s (all
tokens prefilled, and loss-masked), train tok/s (loss-masked positions trained, epochs counted, per
second of the train flow), wall time. The table goes to `reports/scaling.md`, the plot to
`reports/scaling.png` (benchmarks/studies/scaling_results.py: the results file, the tables and the plot).

Run:  nice -n 15 .venv/bin/python -m benchmarks.studies.scaling [--config benchmarks/studies/scaling.yaml]
          [--sizes 25000 50000 ...] [--max-size 1600000] [--controls 50000 200000] [--ks 3 4]
      nice -n 15 .venv/bin/python -m benchmarks.studies.scaling --quick     # smoke run, runs/scaling-quick
      nice -n 15 .venv/bin/python -m benchmarks.studies.scaling --report    # table and plot from scaling.jsonl only
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from benchmarks.report import ROOT
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")

from benchmarks.studies.scaling_results import (  # noqa: E402  (the results file, its table and plot)
    DOMAINS, MAIN, SCRATCH, acceptance_row, append_result, fmt, load_results, missing_ks, point_key, write_report)

DEFAULT_SIZES = [25_000, 50_000, 100_000, 200_000, 400_000]
DEFAULT_CONTROLS = [50_000, 200_000]
QUICK_SIZES, QUICK_CONTROLS = [2_000, 4_000], [2_000]
DRAFTERS = {"eagle3": "eagle3", "final": "eagle3-final-state-only", "lookup": "prompt-lookup"}


# ---------------------------------------------------------------- pure bookkeeping (tested)

def study_sizes(sizes: Iterable[int], max_size: int | None = None) -> list[int]:
    """The sizes asked, plus doublings of the largest up to `max_size`; sorted, distinct."""
    out = sorted({int(s) for s in sizes})
    if not out:
        raise ValueError("no sizes given")
    if max_size is not None:
        s = out[-1]
        while s * 2 <= max_size:
            s *= 2
            out.append(s)
    return out


def generations_for(tokens: Iterable[int], size: int) -> int | None:
    """How many of the first generations (in extraction order, these loss-masked token counts) it takes
    to reach `size` tokens; None when all of them together fall short."""
    total = 0
    for n, t in enumerate(tokens, start=1):
        total += int(t or 0)
        if total >= size:
            return n
    return None


def regenerate_chunk(missing_tokens: int, tokens_per_generation: float | None, lo: int = 16, hi: int = 400) -> int:
    """Prompts to ask the next regenerate call for: the missing tokens at the mean generation's length,
    plus 10%, between `lo` and `hi` (the next call continues, nothing is asked twice)."""
    # mode 'all' answers every user turn: a ShareGPT conversation averages several hundred tokens
    per = tokens_per_generation if tokens_per_generation and tokens_per_generation > 0 else 500.0
    return max(lo, min(hi, math.ceil(round(missing_tokens * 11 / per, 6) / 10)))


# ---------------------------------------------------------------- ablation arms

def parse_change(text: str) -> dict[str, object]:
    """One ablation arm from the command line: `train.lr=0.003` or `train.schedule=cosine,train.total_steps=60`
    (YAML values); `extract.` and `train.` fields, since the arm re-extracts and retrains, and `data.loss_on`
    (`assistant`, the pipeline's samples, or `all`: the same conversations with every token trained on)."""
    import yaml

    change: dict[str, object] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        section, _, name = key.strip().partition(".")
        if not sep or section not in ("extract", "train", "data") or not name:
            raise ValueError(f"ablation {text!r}: expected extract.FIELD=VALUE, train.FIELD=VALUE or "
                             f"data.loss_on=assistant|all, got {part!r}")
        change[f"{section}.{name}"] = yaml.safe_load(value)
        if section == "data" and (name, change[f"{section}.{name}"]) not in (("loss_on", "assistant"), ("loss_on", "all")):
            raise ValueError(f"ablation {text!r}: the data change is data.loss_on=assistant|all, got {part!r}")
    return change


def ablation_arm(change: dict[str, object] | None) -> tuple[str, str]:
    """The arm's name in the results (`scratch` for the plain control) and its workspace and run suffix."""
    if not change:
        return SCRATCH, ""
    label = ",".join(f"{k}={v}" for k, v in change.items())
    slug = "".join(c if c.isalnum() or c in "._-" else "-" for c in label.replace("=", "-").replace(",", "_"))
    return f"{SCRATCH} {label}", f"-{slug}"


def changed_configs(cfg, change: dict[str, object] | None):
    """The extract and train sections with the ablation's fields replaced, validated (an unknown field or a
    bad value fails before any work)."""
    sections = {"extract": cfg.extract.model_dump(), "train": cfg.train.model_dump()}
    for key, value in (change or {}).items():
        section, name = key.split(".", 1)
        if section == "data":
            continue  # the import's loss masks (Study.import_file), not a config field
        if name not in sections[section] or name in ("workspace", "run_name"):
            raise ValueError(f"ablation {key}: {section} has no field {name!r} an ablation may change")
        sections[section][name] = value
    return type(cfg.extract).model_validate(sections["extract"]), type(cfg.train).model_validate(sections["train"])


# ---------------------------------------------------------------- the study

@dataclass
class Costs:
    regen_tokens: int = 0
    regen_s: float = 0.0
    extract_tokens: int = 0
    extract_masked: int = 0
    extract_s: float = 0.0
    target_dtype: str = ""  # what the target computed the states in (`target.dtype: auto` follows the CPU)
    train_positions: int = 0
    train_s: float = 0.0
    rounds: int = 0
    notes: list[str] = field(default_factory=list)

    def rates(self, lineage_regen_rate: float | None) -> dict:
        own = self.regen_tokens / self.regen_s if self.regen_s else None
        return {
            "regen_tok_s": own if own is not None else lineage_regen_rate,
            "regen_tok_s_source": "this point" if own is not None else "lineage (earlier regenerate runs)",
            "regen_tokens": self.regen_tokens, "regen_s": self.regen_s,
            "extract_tok_s": self.extract_tokens / self.extract_s if self.extract_s else None,
            "extract_masked_tok_s": self.extract_masked / self.extract_s if self.extract_s else None,
            "extract_tokens": self.extract_tokens, "extract_s": self.extract_s, "target_dtype": self.target_dtype,
            "train_tok_s": self.train_positions / self.train_s if self.train_s else None,
            "train_positions": self.train_positions, "train_s": self.train_s, "rounds": self.rounds,
        }


def extract_train_rounds(remaining: Callable[[], int], extract: Callable[[int], object], train: Callable[[], object],
                         positions: Callable[[], int], costs: Costs, ws: Path) -> None:
    """The pipeline's extract -> train rounds (tasks/rounds.py) over the generations not yet sampled, until none
    is left: the disk budget stops an extraction early, and training (delete_consumed) frees the room for the next
    round. One round when everything fits. Stops with a clear error when an extraction makes no progress or
    training stops for another reason than running out of data. Costs are counted per stage."""
    from tasks.rounds import RoundsError, UntilAllSampled, run_rounds

    def extract_round(number: int, limit: int | None) -> object:
        t1 = time.monotonic()
        s = extract(limit)
        costs.extract_s += time.monotonic() - t1
        costs.extract_tokens += s.tokens
        costs.extract_masked += s.masked_tokens
        costs.target_dtype = s.target_dtype
        print(f"extract: {s.extracted} samples, {s.tokens:,} tokens ({s.stopped_by})", flush=True)
        return s

    def train_round(number: int) -> object:
        before = positions()
        t1 = time.monotonic()
        ts = train()
        costs.train_s += time.monotonic() - t1
        costs.train_positions += positions() - before
        costs.rounds += 1
        return ts

    try:
        run_rounds(extract_round, train_round, UntilAllSampled(remaining))
    except RoundsError as e:
        raise SystemExit(f"{ws}: {e}") from e


@dataclass
class Measuring:
    """What every point's measuring shares in one process (and the selection study's arms with it): the
    loaded target with its prompts and stop ids, the target's greedy decodings by prompt item id, and
    prompt lookup's fields by k (it reads only the prompt and the target's greedy path, both the same at
    every point, so it is measured once per process: a third of each point's measuring)."""
    target: tuple | None = None
    paths: dict = field(default_factory=dict)
    lookup: dict[int, dict] = field(default_factory=dict)


class Study:
    def __init__(self, cfg, results: Path, ks: list[int], prompts: int, max_new: int, chunk_max: int,
                 chunk_min: int = 16, arm: str = MAIN, measuring: Measuring | None = None) -> None:
        from storage.lineage import LineageStore
        from storage.studies import StudyReads

        self.cfg, self.results, self.ks, self.arm = cfg, results, ks, arm
        self.prompts, self.max_new, self.chunk_max, self.chunk_min = prompts, max_new, chunk_max, chunk_min
        self.ws = Path(cfg.workspace)
        self.store = LineageStore(self.ws / "lineage.duckdb")
        self.reads = StudyReads(self.store)
        self.done = load_results(results)
        self.measuring = measuring or Measuring()
        self._masked: dict[str, int] = {}  # generation id -> loss-masked tokens of its sample

    # -- data
    def ensure_discovered(self) -> None:
        from flows.discover import discover

        if not self.reads.discovered():
            print(f"discover -> {self.ws}", flush=True)
            discover(self.cfg.discover)

    def ensure_generations(self, size: int, costs: Costs) -> int:
        """Regenerate in chunks until the first generations reach `size` tokens; their count."""
        from flows.regenerate import regenerate

        while True:
            tokens = self.masked_tokens(self.reads.generation_tokens())
            n = generations_for(tokens, size)
            if n is not None:
                return n
            have = sum(tokens)
            limit = regenerate_chunk(size - have, have / len(tokens) if tokens else None, lo=self.chunk_min,
                                     hi=self.chunk_max)
            print(f"regenerate: {have:,} of {size:,} tokens, asking {limit} more prompts", flush=True)
            s = regenerate(self.cfg.regenerate.model_copy(update={"limit": limit}))
            costs.regen_tokens += s.completion_tokens
            costs.regen_s += s.seconds
            if s.pending_at_start == 0:
                raise SystemExit(f"{self.ws}: every discovered prompt is answered ({have:,} tokens) and {size:,} are "
                                 "needed: raise discover.sources[].limit and rerun (discover adds the new ones)")

    def masked_tokens(self, gens: list[tuple[str, str, int]]) -> list[int]:
        """Loss-masked tokens of each generation's sample, tokenised exactly as the main extraction tokenises
        (tasks.extract.chat.tokenise_rows with its max_length and overflow; cached): the study's sizes count these,
        not completion tokens (a truncated conversation, or one whose rendering differs from the server's
        ids, trains on fewer tokens than the target wrote)."""
        from storage.datasets import read_generation_rows
        from tasks.extract.chat import Sample, tokenise_rows

        todo = [(g, f) for g, f, _ in gens if g not in self._masked]
        if todo:
            found = self.store.extraction.settings(None)
            settings = found["settings"] if found else {"max_length": self.cfg.extract.max_length,
                                                        "overflow": self.cfg.extract.overflow}
            _, tokenizer, identity, _, _ = self.target()
            rows = read_generation_rows(self.ws / "data" / "generations", todo)
            for (g, _), t in zip(todo, tokenise_rows(tokenizer, rows, settings["max_length"], settings["overflow"],
                                                      identity.chat_template)):
                self._masked[g] = int(sum(t.result.loss_mask)) if isinstance(t.result, Sample) else 0
        return [self._masked[g] for g, _, _ in gens]

    # -- measuring
    def target(self):
        if self.measuring.target is None:
            from tasks.evaluate.offline import benchmark_sets, prompts_for_benchmark
            from tasks.evaluate.heldout import heldout_set
            from tasks.model.target import load_configured_target, stop_token_ids

            t = self.cfg.bench_section().target
            model, tokenizer, identity = load_configured_target(t.gguf, t.model_path, t.revision, t.trust_remote_code,
                                                                t.dtype, t.device)
            held = heldout_set(self.store.discover.heldout_prompts())
            if held is None:
                raise SystemExit(f"{self.ws}: no held-out prompts (discover.heldout)")
            sets = [held] + benchmark_sets(True)
            prompts = prompts_for_benchmark(tokenizer, identity.chat_template, sets, self.prompts)
            self.measuring.target = (model, tokenizer, identity, prompts, stop_token_ids(model, tokenizer))
        return self.measuring.target

    def measure(self, export: str, ks: list[int]) -> dict[int, dict]:
        from tasks.evaluate.offline import evaluate_acceptance, load_draft_for_target, standard_drafters

        model, _, _, prompts, stops = self.target()
        draft = load_draft_for_target(export, model)  # the serving contract is checked first
        if draft.fc.weight.device.type == "cpu":
            draft = draft.float()
        out = {}
        for k in ks:
            t0 = time.monotonic()
            drafters = standard_drafters(draft)
            if k in self.measuring.lookup:
                drafters = [d for d in drafters if d.name != DRAFTERS["lookup"]]
            report = evaluate_acceptance(model, prompts, drafters, k, self.max_new, stops, paths=self.measuring.paths)
            row: dict = {"measure_s": time.monotonic() - t0, "lossless_checked": report.lossless_checked,
                         **acceptance_row(report, DRAFTERS)}
            self.measuring.lookup.setdefault(k, {key: v for key, v in row.items() if key.startswith("lookup_")})
            out[k] = {**self.measuring.lookup[k], **row}
        return out

    # -- arms
    def record(self, arm: str, size: int, measured: dict[int, dict], info: dict) -> None:
        for k, row in measured.items():
            full = {"arm": arm, "size": size, "k": k, **info, **row,
                    "max_new_tokens": self.max_new, "prompts_per_domain": self.prompts,
                    "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            append_result(self.results, full)
            self.done[point_key(arm, size, k)] = full

    def remeasure(self, size: int) -> None:
        """Measure a recorded point's draft again when the point lacks the per-prompt figures (recorded since
        2026-12-05) and its export is still on this machine: the same draft, target and prompts, so the
        figures repeat and the point gains its prompts. Appended as the point's new line (the last wins)."""
        for k in self.ks:
            old = self.done.get(point_key(self.arm, size, k))
            if old is None or f"eagle3_{DOMAINS[0]}_per_request" in old or not Path(old["export"]).exists():
                continue
            info = {key: v for key, v in old.items() if key not in ("arm", "size", "k", "recorded_at")}
            info["first_recorded_at"] = old["recorded_at"]
            self.record(self.arm, size, self.measure(old["export"], [k]), info)
            print(f"{self.arm} {size:,}: measured again, per prompt", flush=True)

    def main_point(self, size: int) -> None:
        from flows.extract import extract
        from flows.train import train

        ks = missing_ks(self.done, self.arm, size, self.ks)
        if not ks:
            print(f"{self.arm} {size:,}: measured, skipped", flush=True)
            return
        t0 = time.monotonic()
        costs = Costs()
        run_name = self.cfg.train.run_name
        n_gen = self.ensure_generations(size, costs)
        if self.reads.sampled_generations() > n_gen:
            print(f"{self.arm} {size:,}: the draft already holds more data than {size:,} tokens (a larger size was run "
                  "first); skipped", flush=True)
            return
        extract_train_rounds(lambda: n_gen - self.reads.sampled_generations(),
                             lambda limit: extract(self.cfg.extract.model_copy(update={"limit": limit})),
                             lambda: train(self.cfg.train), lambda: self.reads.trained_positions(run_name),
                             costs, self.ws)
        row = self.store.checkpoints.find(fmt="sglang")
        if row is None:
            raise SystemExit(f"{self.ws}: no SGLang export after training")
        measured = self.measure(row["path"], ks)
        samples, tokens, masked = self.reads.extracted_tokens()
        info = {"run_name": run_name, "checkpoint": row["checkpoint"], "export": row["path"],
                "generations": n_gen, "samples": samples, "sample_tokens": tokens, "train_tokens": masked,
                "trained_positions": self.reads.trained_positions(run_name),
                **costs.rates(self.reads.regenerate_rate()), "wall_s": time.monotonic() - t0}
        self.record(self.arm, size, measured, info)
        self.show(self.arm, size)

    def control_point(self, size: int, change: dict[str, object] | None = None) -> None:
        """A from-scratch draft on the main arm's first `size` tokens; with `change` (an ablation: dotted
        `extract.` / `train.` fields and their values) the same, with that one thing changed."""
        from flows.extract import extract
        from flows.regenerate import regenerate
        from flows.train import train
        from storage.lineage import LineageStore
        from storage.studies import StudyReads
        from tasks.config import ImportConfig, RegenerateConfig
        from tasks.model.target import embedded_identity

        arm, slug = ablation_arm(change)
        if self.arm != MAIN:  # an arm of another study (benchmarks/studies/selection.py): its controls carry its name
            arm = f"{self.arm} {arm}"
        ks = missing_ks(self.done, arm, size, self.ks)
        if not ks:
            print(f"{arm} {size:,}: measured, skipped", flush=True)
            return
        extract_cfg, train_cfg = changed_configs(self.cfg, change)
        t0 = time.monotonic()
        costs = Costs()
        n_gen = self.ensure_generations(size, costs)  # normally there already: the main arm ran this size
        cws = self.ws / "controls" / f"scratch-{size}{slug}"
        cstore = LineageStore(cws / "lineage.duckdb")
        creads = StudyReads(cstore)
        run_name = f"{self.cfg.train.run_name}-scratch-{size}{slug}"
        if not creads.generation_tokens():
            path = self.import_file(n_gen, cws / "imports" / f"first-{size}.jsonl",
                                    loss_on=str((change or {}).get("data.loss_on", "assistant")))
            _, revision, template_id = embedded_identity(
                self.cfg.regenerate.embedded_server.gguf if self.cfg.regenerate.embedded_server else None)
            d = self.cfg.discover
            t1 = time.monotonic()
            s = regenerate(RegenerateConfig(
                workspace=str(cws), target_model=self.cfg.regenerate.target_model, target_revision=revision,
                chat_template_id=template_id, sampling=self.cfg.regenerate.sampling,
                imports=[ImportConfig(name=f"first-{size}", path=str(path), near_dedupe=d.near_dedupe,
                                      decontaminate=d.decontaminate)]))
            costs.notes.append(f"imported {s.imported} of {n_gen} generations in {time.monotonic() - t1:.0f} s")
            print(f"{arm} {size:,}: imported {s.imported} of {n_gen} generations into {cws}", flush=True)
        # every imported generation, in as many extract -> train rounds as the disk budget takes
        imported = len(creads.generation_tokens())
        extract_train_rounds(lambda: imported - creads.sampled_generations(),
                             lambda limit: extract(extract_cfg.model_copy(update={"workspace": str(cws),
                                                                                   "limit": limit})),
                             lambda: train(train_cfg.model_copy(update={"workspace": str(cws), "run_name": run_name})),
                             lambda: creads.trained_positions(run_name), costs, cws)
        row = cstore.checkpoints.find(fmt="sglang")
        if row is None:
            raise SystemExit(f"{cws}: no SGLang export after training")
        measured = self.measure(row["path"], ks)
        samples, tokens, masked = creads.extracted_tokens()
        info = {"run_name": run_name, "workspace": str(cws), "checkpoint": row["checkpoint"], "export": row["path"],
                "generations": n_gen, "samples": samples, "sample_tokens": tokens, "train_tokens": masked,
                "trained_positions": creads.trained_positions(run_name), "notes": costs.notes,
                "change": change or {}, **costs.rates(self.reads.regenerate_rate()),
                "wall_s": time.monotonic() - t0}
        self.record(arm, size, measured, info)
        self.show(arm, size)

    def import_file(self, n_gen: int, path: Path, loss_on: str = "assistant") -> Path:
        """The first n_gen generations of the main workspace as import records: their conversations with the
        token ids and loss masks the main extraction made of them (so the control trains on the same samples);
        `loss_on="all"`: every token's mask set (system and user turns and template tokens trained on too)."""
        from storage.datasets import read_generation_rows
        from tasks.extract.chat import Sample, tokenise_rows

        found = self.store.extraction.settings(None)
        if found is None:
            raise SystemExit(f"{self.ws}: no extraction yet; the main arm makes it")
        settings = found["settings"]
        _, tokenizer, identity, _, _ = self.target()
        wanted = self.reads.first_generations(n_gen)
        rows = read_generation_rows(self.ws / "data" / "generations", wanted)
        tokenised = tokenise_rows(tokenizer, rows, settings["max_length"], settings["overflow"], identity.chat_template)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        with tmp.open("w") as f:
            for row, t in zip(rows, tokenised):
                if isinstance(t.result, Sample):
                    msgs = [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
                    mask = [1] * len(t.result.loss_mask) if loss_on == "all" else list(map(int, t.result.loss_mask))
                    f.write(json.dumps({"messages": msgs, "input_ids": list(map(int, t.result.input_ids)),
                                        "loss_mask": mask}) + "\n")
        tmp.replace(path)
        return path

    def show(self, arm: str, size: int) -> None:
        r = self.done.get(point_key(arm, size, self.ks[0]))
        if r:
            print(f"{arm} {size:,}: {r['train_tokens']:,} training tokens, k={r['k']}: heldout_chat "
                  f"{fmt(r.get('eagle3_heldout_chat'))} humaneval {fmt(r.get('eagle3_humaneval'))} (prompt lookup "
                  f"{fmt(r.get('lookup_heldout_chat'))} / {fmt(r.get('lookup_humaneval'))}); regen "
                  f"{fmt(r.get('regen_tok_s'), 0)} tok/s, extract {fmt(r.get('extract_tok_s'), 0)} tok/s, train "
                  f"{fmt(r.get('train_tok_s'), 0)} tok/s, wall {r['wall_s']:.0f} s", flush=True)


# ---------------------------------------------------------------- config and entry point

def quick_config(cfg):
    """The smoke run's config: its own workspace, few prompts, short answers, another server port."""
    data = cfg.model_dump(mode="json")
    data["workspace"] = "runs/scaling-quick"
    for stage in ("discover", "regenerate", "extract", "train", "benchmark"):
        if data.get(stage) is not None:
            data[stage]["workspace"] = "runs/scaling-quick"
    for src in data["discover"]["sources"]:
        src["limit"] = 300
    data["discover"]["heldout"] = {**data["discover"]["heldout"], "fraction": 0.05, "cap": 16}
    data["regenerate"]["embedded_server"]["port"] = 8091
    data["regenerate"]["write_batch"] = 8
    data["benchmark"].update(prompts_per_domain=4, max_new_tokens=16)
    from tasks.config import PipelineConfig

    return PipelineConfig.model_validate(data)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=ROOT / "benchmarks" / "studies" / "scaling.yaml")
    ap.add_argument("--sizes", type=int, nargs="*", default=None,
                    help="training tokens of each point (none: only controls and ablations)")
    ap.add_argument("--max-size", type=int, default=None, help="add doublings of the largest size up to this")
    ap.add_argument("--controls", type=int, nargs="*", default=None, help="sizes of the from-scratch controls")
    ap.add_argument("--ks", type=int, nargs="+", default=[3, 4], help="chain depths measured")
    ap.add_argument("--chunk", type=int, default=400, help="most prompts per regenerate call")
    ap.add_argument("--chunk-min", type=int, default=None, help="fewest prompts per regenerate call (16; quick: 4)")
    ap.add_argument("--quick", action="store_true", help="smoke run: sizes 2000 4000, control 2000, runs/scaling-quick")
    ap.add_argument("--resume", action="store_true", default=True, help="skip measured points (the default)")
    ap.add_argument("--report", action="store_true", help="only write the table and plot from the results file")
    ap.add_argument("--ablate", nargs="*", default=[], metavar="SECTION.FIELD=VALUE[,...]",
                    help="ablation arms: each a from-scratch draft at --ablate-size with these fields changed")
    ap.add_argument("--ablate-size", type=int, default=50_000, help="training tokens of the ablation arms")
    args = ap.parse_args()

    from tasks.config import load_config

    cfg = load_config(args.config)
    if args.quick:
        cfg = quick_config(cfg)
    changes = [parse_change(a) for a in args.ablate]
    for change in changes:
        changed_configs(cfg, change)  # refuse a bad arm before hours of work
    asked = args.sizes if args.sizes is not None else (QUICK_SIZES if args.quick else DEFAULT_SIZES)
    sizes = study_sizes(asked, args.max_size) if asked else []
    controls = sorted(set(args.controls if args.controls is not None else
                          (QUICK_CONTROLS if args.quick else DEFAULT_CONTROLS)))
    results = Path(cfg.workspace) / "reports" / "scaling.jsonl"
    if args.report:
        print(write_report(results, args.ks[0]))
        return

    from flows.prefect_api import start_local_api
    from serving.llamacpp.server import free_port

    home = Path(tempfile.mkdtemp(prefix="eagle3-scaling-prefect-"))
    port = free_port()
    os.environ["PREFECT_HOME"] = str(home)
    os.environ["PREFECT_API_URL"] = f"http://127.0.0.1:{port}/api"
    _, server = start_local_api(home, port)
    started = time.monotonic()
    try:
        bench = cfg.bench_section()
        study = Study(cfg, results, args.ks, bench.prompts_per_domain, bench.max_new_tokens, args.chunk,
                      args.chunk_min or (4 if args.quick else 16))
        print(f"scaling study in {cfg.workspace}: sizes {sizes}, controls {controls}, k {args.ks}; "
              f"{len(study.done)} point(s) already measured", flush=True)
        study.ensure_discovered()
        for size in sizes:
            study.main_point(size)
            if size in controls:
                study.control_point(size)
        for size in controls:
            if size not in sizes:
                study.control_point(size)
        for change in changes:
            study.control_point(args.ablate_size, change)
    finally:
        if server is not None:
            server.terminate()
    print(f"\nstudy wall time this run: {time.monotonic() - started:.0f} s\n")
    print(write_report(results, args.ks[0]))
    print(f"\n{results.parent / 'scaling.md'}\n{results.parent / 'scaling.png'}")


if __name__ == "__main__":
    main()
