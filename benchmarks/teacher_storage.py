"""Which teacher and storage dtype should extract use by default? Measured by acceptance, not by size.

For each (teacher, storage) option the same generations are extracted, the same draft is trained
with the same seed and steps, and the offline benchmark measures acceptance on held-out prompts.
The table shows bytes per token (against 4 x H x 2, three aux layers plus the final state in bf16)
next to the acceptance length each option leads to.

The target is a small random Llama with SmolLM2's tokenizer and a confident head (benchmarks/fixtures.py),
so that a full comparison runs on a CPU in minutes: the draft learns the target's function from
its states exactly as it would for a trained model, but absolute acceptance says nothing about
SmolLM2 or Kimi. Run: `.venv/bin/python -m benchmarks.teacher_storage [--quick]`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")

OPTIONS = [("final_hidden", "bf16"), ("final_hidden", "fp8"), ("topk", "bf16"), ("topk", "fp8")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer samples and steps (a smoke run)")
    ap.add_argument("--topk", type=int, default=20)
    args = ap.parse_args()
    n_train, n_eval, epochs = (40, 6, 4) if args.quick else (160, 16, 6)

    from flows.prefect_api import start_local_api
    from serving.llamacpp.server import free_port

    home = Path(tempfile.mkdtemp(prefix="eagle3-bench-prefect-"))
    port = free_port()
    os.environ["PREFECT_HOME"] = str(home)
    os.environ["PREFECT_API_URL"] = f"http://127.0.0.1:{port}/api"
    _, server = start_local_api(home, port)
    try:
        run(n_train, n_eval, epochs, args.topk)
    finally:
        if server is not None:
            server.terminate()


def run(n_train: int, n_eval: int, epochs: int, topk: int) -> None:
    import torch

    from flows.extract import extract
    from flows.train import train
    from benchmarks.fixtures import conversations, extract_config, import_generations, make_tiny_target
    from storage.lineage import LineageStore
    from tasks.config import TrainConfig
    from tasks.evaluate.offline import offline_acceptance
    from serving.sglang.export import load_sglang
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    root = Path(tempfile.mkdtemp(prefix="eagle3-teacher-storage-"))
    target_dir = make_tiny_target(root / "target")
    base = root / "base"
    import_generations(base, root, conversations(n_train, seed=21))
    target = {"model_path": str(target_dir), "dtype": "float32", "device": "cpu"}
    held_out = [c["messages"][0]["content"] for c in conversations(n_eval, seed=99)]
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    hidden = model.config.hidden_size
    rows = []
    for teacher, storage in OPTIONS:
        ws = root / f"{teacher}-{storage}"
        shutil.copytree(base, ws)
        t0 = time.perf_counter()
        s = extract(extract_config(ws, target_dir, teacher=teacher, storage=storage, topk=topk, draft_vocab_size=512))
        extract_s = time.perf_counter() - t0
        t = train(TrainConfig(workspace=str(ws), run_name="cmp", target=target, ttt_steps=4, epochs=epochs,
                              batch_tokens=1024, lr=3e-3, seed=0, log_every=5))
        draft = load_sglang(t.exports["sglang"], embed_tokens=model.get_input_embeddings().weight.detach()).eval()
        report = offline_acceptance(model, tokenizer, draft, sets=[("held-out", held_out)], limit=n_eval, k=4,
                                    max_new_tokens=32, baselines=False)
        agg = report.get("eagle3")
        metrics = LineageStore(ws / "lineage.duckdb").training.metrics("cmp")
        rows.append({
            "teacher": teacher, "storage": storage,
            "bytes/token": s.bytes_written / s.tokens,
            "x baseline 4*H*2": s.bytes_written / s.tokens / (4 * hidden * 2),
            "train acc step0 (last)": metrics[-1]["accuracy"][0],
            "acceptance (token-weighted)": agg.acceptance_length_token_weighted,
            "acceptance (request mean)": agg.acceptance_length_request_mean,
            "extract s": extract_s,
        })
        print(rows[-1], flush=True)
    ref = rows[0]["acceptance (token-weighted)"]
    print(f"\n{n_train} training conversations, {epochs} epochs, k=4, {n_eval} held-out prompts x 32 tokens, "
          f"tiny target H={hidden}; bytes/token at SmolLM2's H=576: benchmarks/extract.py\n")
    head = ["teacher", "storage", "bytes/token", "x baseline 4*H*2", "train acc step0 (last)",
            "acceptance (token-weighted)", "acceptance (request mean)", "acc. vs final_hidden/bf16"]
    print(" | ".join(head))
    for r in rows:
        r["acc. vs final_hidden/bf16"] = r["acceptance (token-weighted)"] / ref
        print(" | ".join(f"{r[h]:.3f}" if isinstance(r[h], float) else str(r[h]) for h in head))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
