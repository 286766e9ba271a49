"""The layer mapping, proven in the real engine: the same trained draft converted to GGUF with the
right layer ids (ours + 1: llama.cpp captures a layer's input) and with the ids one too low (ours
written as they are, the natural mistake), each served by llama-server with the target, greedy,
chain depth k, on the same prompts. The wrong mapping feeds the draft other layers' states than it
was trained on: acceptance must drop, and the doctor must name it.

Also runs the doctor (engine llamacpp) on every GGUF, when the doctor has that engine. `--far A B C`
adds a third GGUF reading other layers altogether, which shows how much the draft relies on its
states at all.

A draft that barely uses the target's states (the demo's, trained on 24 conversations) cannot show
it: both mappings accept the same few tokens. `--training-prompts WORKSPACE` serves instead the
exact prompt ids of that workspace's generations (what the draft was trained on), where a draft
trained to fit them relies on the states it was trained with.

Run: .venv/bin/python -m benchmarks.studies.layer_mapping SGLANG_EXPORT_DIR [--prompts 12] [--max-tokens 64] [-k 3]
       [--far A B C]
       [--training-prompts WORKSPACE [--max-length EXTRACT_MAX_LENGTH]]
     (SGLANG_EXPORT_DIR: a trained export, e.g. runs/demo/checkpoints/demo-draft/export/sglang-step-N)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path


import httpx

from benchmarks.report import load, table
from serving.llamacpp.server import LlamaCppServer, Speculation
from tasks.evaluate.offline import benchmark_sets, prompts_for_benchmark
from serving.sglang.layers import sglang_layer_ids
from serving.llamacpp.export import export_gguf, read_gguf_draft, target_folder_for
from tasks.model.target import gguf_chat_template, load_target, smollm2_gguf_path


def relabelled_copy(export: Path, out: Path, aux_layer_ids: list[int]) -> Path:
    """A copy of the SGLang export claiming it was trained on `aux_layer_ids` (weights unchanged)."""
    shutil.copytree(export, out)
    config = json.loads((out / "config.json").read_text())
    record = config["eagle3_pipeline"]
    record["aux_layer_ids"] = list(aux_layer_ids)
    record["sglang_version"] = "before-pr25454"  # one SGLang convention that can write these ids
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = sglang_layer_ids(
        sorted(aux_layer_ids), record["target_num_layers"], record["sglang_version"])
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def training_prompts(workspace: Path, n: int, max_tokens: int, max_length: int) -> list[tuple[list[int], bool]]:
    """(prompt ids as the embedded server was sent them, trained) for each regenerated turn, trained first.

    A turn is trained when its prompt and its first `max_tokens` completion tokens fit in
    `max_length` (the extract stage's cap, truncating): the sample then holds the exact tokens a
    greedy replay produces, and a draft that memorised them must be accepted there.
    """
    import pyarrow.parquet as pq

    turns = []
    for file in sorted((workspace / "data" / "generations").glob("*/*.parquet")):
        for row in pq.read_table(file, columns=["turns"]).to_pylist():
            for turn in row["turns"] or []:
                ids = turn.get("prompt_token_ids")
                if ids:
                    done = min(len(turn.get("completion_token_ids") or []), max_tokens)
                    turns.append((list(ids), len(ids) + done <= max_length))
    return sorted(turns, key=lambda t: not t[1])[:n]


def serve_and_measure(draft: Path, prompts: list[list[int]], k: int, max_tokens: int, threads: int) -> dict:
    speculation = Speculation("draft-eagle3", draft_gguf=draft, n_max=k)
    tokens = accepted = drafted = 0
    outputs, per_prompt = [], []
    with LlamaCppServer(smollm2_gguf_path(), n_ctx=2048, n_threads=threads, speculation=speculation) as server:
        for ids in prompts:
            r = httpx.post(server.base_url + "/completion", timeout=600, json={
                "prompt": ids, "n_predict": max_tokens, "temperature": 0.0, "repeat_penalty": 1.0,
                "return_tokens": True, "cache_prompt": False}).json()
            t = r["timings"]
            tokens += t["predicted_n"]
            accepted += t.get("draft_n_accepted", 0)
            drafted += t.get("draft_n", 0)
            outputs.append(r["tokens"])
            per_prompt.append((t["predicted_n"], t.get("draft_n_accepted", 0)))
    rounds = tokens - len(prompts) - accepted  # target forwards after each prefill
    return {"tokens": tokens, "accepted": accepted, "drafted": drafted, "rounds": rounds,
            "acceptance": tokens / rounds if rounds else None, "outputs": outputs,
            "per_prompt": per_prompt}


def acceptance_of(per_prompt: list[tuple[int, int]]) -> float | None:
    """Tokens per target forward over these prompts (the prefill's own token is not a forward's gain)."""
    tokens = sum(n for n, _ in per_prompt)
    rounds = tokens - len(per_prompt) - sum(a for _, a in per_prompt)
    return tokens / rounds if rounds > 0 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("export", type=Path)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("-k", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--training-prompts", type=Path, help="serve this workspace's generation prompts (ids as sent)")
    ap.add_argument("--max-length", type=int, default=2048,
                    help="the extract stage's max_length the draft was trained with (which turns it saw whole)")
    ap.add_argument("--far", type=int, nargs=3, metavar="ID",
                    help="also serve a GGUF that reads these layers (project convention), far from the trained ones")
    args = ap.parse_args()

    started = time.monotonic()
    load_before = load()
    if args.training_prompts:
        chosen = training_prompts(args.training_prompts, args.prompts, args.max_tokens, args.max_length)
        prompts = [ids for ids, _ in chosen]
        trained = [was for _, was in chosen]
        where = (f"training prompts of {args.training_prompts} ({sum(trained)} whose {args.max_tokens} greedy tokens "
                 f"lie inside a trained sample of <= {args.max_length} tokens)")
    else:
        _, tokenizer = load_target()
        bench = prompts_for_benchmark(tokenizer, gguf_chat_template(smollm2_gguf_path()), benchmark_sets(True),
                                      args.prompts)
        prompts = [p.input_ids for p in bench]
        trained = [False] * len(prompts)
        where = "HumanEval prompts"
    target_dir = target_folder_for()
    work = Path(tempfile.mkdtemp(prefix="layer-mapping-"))
    trained_ids = json.loads((args.export / "config.json").read_text())["eagle3_pipeline"]["aux_layer_ids"]
    variants = {"right (ours + 1)": export_gguf(args.export, target_dir, work / "right.gguf"),
                "one too low (ours as written)": export_gguf(
                    relabelled_copy(args.export, work / "low", [i - 1 for i in trained_ids]), target_dir,
                    work / "low.gguf")}
    if args.far:
        variants[f"other layers {args.far}"] = export_gguf(
            relabelled_copy(args.export, work / "far", args.far), target_dir, work / "far.gguf")
    results = {name: serve_and_measure(path, prompts, args.k, args.max_tokens, args.threads)
               for name, path in variants.items()}
    doctor = {}
    try:
        from serving.doctor import run_doctor

        for name, path in variants.items():
            report = run_doctor(path, target_dir, engine="llamacpp", expected_aux_layer_ids=trained_ids)
            doctor[name] = "passes" if report.passed else "; ".join(c.name for c in report.checks if not c.ok)
    except (ImportError, ValueError, KeyError) as e:  # the doctor may not know llama.cpp yet
        doctor = {name: f"n/a ({type(e).__name__})" for name in variants}
    right = results["right (ours + 1)"]
    rows = []
    for name, r in results.items():
        same = sum(a == b for a, b in zip(r["outputs"], right["outputs"]))
        split = [acceptance_of([p for p, was in zip(r["per_prompt"], trained) if was == want]) for want in (True, False)]
        rows.append([name, str(read_gguf_draft(variants[name]).target_layers), r["tokens"], r["rounds"],
                     f"{r['accepted']}/{r['drafted']}", f"{r['acceptance']:.3f}",
                     f"{r['acceptance'] / right['acceptance']:.2f}x",
                     *(f"{a:.3f}" if a is not None else "-" for a in split),
                     f"{same}/{len(prompts)}", doctor.get(name, "")])
    table(f"Layer mapping in llama-server: {args.export.name}, {len(prompts)} {where}, greedy, k={args.k}, "
          f"{args.max_tokens} new tokens (load {load_before} -> {load()}; {time.monotonic() - started:.0f} s)",
          ["GGUF ids", "target_layers", "tokens", "target forwards", "accepted/drafted", "acceptance", "vs right",
           f"acceptance, {sum(trained)} trained", f"acceptance, {len(trained) - sum(trained)} other",
           "same output as right", "doctor"], rows)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
