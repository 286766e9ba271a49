"""The vllm extraction backend against the hf one: tokens/s on the same samples, state parity, and
whether a draft trained on either backend's shards accepts the same.

Speed: both extractors on the same real ShareGPT chats rendered with the serving template, in one
run; each first extracts a warm-up sample, then the timed set (vLLM's start-up is reported apart:
a flow pays it once per run). Parity: max and mean error of the stored states, per token relative
to the token's largest value (one bf16 rounding step is <= 2^-7 of it). Acceptance: the extract
flow on each backend, then the same draft training (same seed, steps, order) and the same
offline benchmark (held-out ShareGPT prompts, chain depth 3, greedy).

Run (after `make vllm`): `.venv/bin/python -m benchmarks.extract_vllm [--dtype bfloat16] [--no-train]`.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=48, help="ShareGPT chats extracted (and trained on)")
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="both engines' dtype (float32 default: this CPU has no native bf16)")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--no-train", action="store_true", help="speed and parity only")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--eval-prompts", type=int, default=16)
    args = ap.parse_args()

    from flows.prefect_api import start_local_api
    from serving.llamacpp.server import free_port

    home = Path(tempfile.mkdtemp(prefix="eagle3-bench-prefect-"))
    port = free_port()
    os.environ["PREFECT_HOME"] = str(home)
    os.environ["PREFECT_API_URL"] = f"http://127.0.0.1:{port}/api"
    _, server = start_local_api(home, port)
    try:
        run(args)
    finally:
        if server is not None:
            server.terminate()


def rel_err(a, b) -> tuple[float, float]:
    a, b = a.float(), b.float()
    rel = (a - b).abs() / b.abs().amax(dim=-1, keepdim=True).clamp_min(1e-6)
    return float(rel.max()), float(rel.mean())


def run(args) -> None:
    import torch

    from benchmarks.fixtures import sharegpt_chats
    from serving.vllm.extract_server import VllmHiddenStatesServer, VllmLaunch, vllm_layer_ids
    from tasks.extract.hf_backend import ExtractSettings, HFExtractor, default_aux_layer_ids
    from tasks.extract.vllm_backend import VllmExtractor, load_final_norm_and_head
    from tasks.model.target import load_configured_target, load_configured_target_files

    root = Path(tempfile.mkdtemp(prefix="eagle3-extract-vllm-"))
    files = load_configured_target_files(None, None, dtype=args.dtype)
    model, tokenizer, _ = load_configured_target(None, None, dtype=args.dtype, device="cpu")
    chats = sharegpt_chats(args.samples + 1 + args.eval_prompts, max_chars=4000)
    train_chats, eval_chats = chats[:args.samples + 1], chats[args.samples + 1:]
    samples = []
    for msgs in train_chats:
        ids = tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"][:args.max_length]
        samples.append((list(ids), [1] * len(ids)))
    warm, timed = samples[:1], samples[1:]
    tokens = sum(len(ids) for ids, _ in timed)
    L = model.config.num_hidden_layers
    settings = ExtractSettings(aux_layer_ids=default_aux_layer_ids(L))
    print(f"{len(timed)} ShareGPT chats, {tokens} tokens (<= {args.max_length} each), SmolLM2-135M {args.dtype}, "
          f"{os.cpu_count()} cores", flush=True)

    hf = HFExtractor(model, settings, max_batch_tokens=8192)
    hf.extract(warm)
    t0 = time.perf_counter()
    hf_recs = hf.extract(timed)
    hf_s = time.perf_counter() - t0
    print(f"hf:   {hf_s:.1f} s, {tokens / hf_s:.0f} tok/s", flush=True)

    launch = VllmLaunch(model=files.folder, layer_ids=vllm_layer_ids(settings.aux_layer_ids, L),
                        states_dir=root / "states", dtype=args.dtype, max_model_len=args.max_length + 1,
                        max_num_seqs=args.max_num_seqs)
    with VllmHiddenStatesServer(launch, log_path=root / "vllm.log") as server:
        norm, eps, _ = load_final_norm_and_head(files.folder, files.config)
        ex = VllmExtractor(server, settings, files.config, norm, eps, concurrency=args.max_num_seqs)
        ex.extract(warm)
        t0 = time.perf_counter()
        v_recs = ex.extract(timed)
        v_s = time.perf_counter() - t0
        print(f"vllm: {v_s:.1f} s, {tokens / v_s:.0f} tok/s (start-up {server.startup_s:.0f} s, vLLM {server.version})",
              flush=True)
    H = model.config.hidden_size
    errs = [rel_err(g.aux_hidden[:, j * H:(j + 1) * H], w.aux_hidden[:, j * H:(j + 1) * H])
            for g, w in zip(v_recs, hf_recs) for j in range(3)]
    errs += [rel_err(g.final_hidden, w.final_hidden) for g, w in zip(v_recs, hf_recs)]
    identical = sum(int(torch.equal(g.aux_hidden, w.aux_hidden)) for g, w in zip(v_recs, hf_recs))
    print(f"\n| backend | tok/s | vs hf |\n|---|---:|---:|\n| hf | {tokens / hf_s:.0f} | 1.00x |\n"
          f"| vllm | {tokens / v_s:.0f} | {hf_s / v_s:.2f}x |")
    print(f"stored states (bf16), vllm vs hf: max rel err {max(e[0] for e in errs):.2e}, "
          f"mean {sum(e[1] for e in errs) / len(errs):.2e}; samples with bit-identical aux states: "
          f"{identical}/{len(timed)}", flush=True)
    if not args.no_train:
        acceptance(args, root, train_chats, eval_chats, model, tokenizer)
    shutil.rmtree(root, ignore_errors=True)


def acceptance(args, root: Path, train_chats, eval_chats, model, tokenizer) -> None:
    from flows.extract import extract
    from flows.train import train
    from benchmarks.fixtures import extract_config, import_generations
    from tasks.config import TrainConfig
    from tasks.evaluate.offline import offline_acceptance
    from serving.sglang.export import load_sglang

    base = root / "base"
    import_generations(base, root, [{"messages": m} for m in train_chats])
    held_out = [m[0]["content"] for m in eval_chats]
    target = {"dtype": args.dtype, "device": "cpu"}
    rows = []
    for backend in ("hf", "vllm"):
        ws = root / backend
        shutil.copytree(base, ws)
        cfg = extract_config(ws, None, backend=backend, max_length=args.max_length, draft_vocab_size=8192,
                             shard_bytes=64 * 2**20, disk_budget_bytes=2**31, max_batch_tokens=8192,
                             vllm={"max_num_seqs": args.max_num_seqs})
        cfg = cfg.model_copy(update={"target": cfg.target.model_copy(update=target)})
        t0 = time.perf_counter()
        s = extract(cfg)
        extract_s = time.perf_counter() - t0
        t = train(TrainConfig(workspace=str(ws), run_name="cmp", target=target, ttt_steps=3, epochs=args.epochs,
                              batch_tokens=2048, lr=1e-3, seed=0, log_every=10))
        draft = load_sglang(t.exports["sglang"], embed_tokens=model.get_input_embeddings().weight.detach()).eval()
        report = offline_acceptance(model, tokenizer, draft, sets=[("held-out", held_out)], limit=len(held_out),
                                    k=3, max_new_tokens=64, baselines=False)
        agg = report.get("eagle3")
        rows.append((backend, s.extracted, s.tokens, extract_s, agg.acceptance_length_token_weighted))
        print(rows[-1], flush=True)
    print(f"\n{len(train_chats)} chats, {args.epochs} epochs, ttt 3, seed 0; {len(held_out)} held-out ShareGPT prompts "
          f"x 64 tokens, k=3, greedy\n\n| backend | samples | tokens | extract flow s (incl. start-up) | "
          f"acceptance |\n|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.0f} | {r[4]:.3f} |")


if __name__ == "__main__":
    main()
