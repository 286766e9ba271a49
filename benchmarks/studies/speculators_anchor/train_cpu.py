"""vLLM's trainer, `speculators` 0.9.0, training an EAGLE-3 draft on a CPU in one process (`.venv-speculators` only).

A runtime shim: it calls speculators' own entry point (`speculators.train.cli.main(TrainConfig.resolve(argv))`,
what `speculators train` runs) and patches, in this process only, what assumes an accelerator; no file of the
installed package is edited:
1. `trainer.get_local_rank` -> "cpu": `Trainer.setup_model` does `model.to(local_rank)` (0 means cuda:0), and
   every batch is moved the same way;
2. the trainer's autocast device -> "cpu" (without an accelerator it falls back to "cuda", whose autocast is then
   off, leaving bf16 states against float32 weights);
3. the step timer without `torch.accelerator.synchronize()`, which raises without an accelerator;
4. the checkpointer's device -> "cpu" (read on resume);
5. (`--muon-ns-fp32`, on) Muon's Newton-Schulz iteration in float32: torch runs it in bfloat16, which a CPU
   without native bf16 (AVX2 only) takes 25 s a step for, against 1 s; same algorithm, more precise.
Flags, not patches: `--loss-implementation eager` (the fused loss imports triton), `--draft-attn-impl sdpa`,
`--num-workers 0`, `--on-missing raise` (never asks a vLLM server for missing states). torch.distributed is never
started. Anything after `--` goes to speculators verbatim. Rerunning with the same --save-path resumes (its default).

    .venv-speculators/bin/python benchmarks/studies/speculators_anchor/train_cpu.py --data DATA --verifier TARGET \\
        --save-path OUT --epochs 1 --total-seq-len 2048 --hidden-states-dtype float32 --no-norm-before-residual
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.pop("LOCAL_RANK", None)  # never distributed


def apply_cpu_patches() -> None:
    import speculators.train.checkpointer as ckpt
    import speculators.train.cli as cli
    import speculators.train.trainer as tr

    tr.get_local_rank = lambda: "cpu"  # 1

    class CPUTrainer(tr.Trainer):  # 2
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.device_type = "cpu"

    cli.Trainer = CPUTrainer
    tr.Trainer = CPUTrainer

    def mark(self, name):  # 3
        if self.enabled:
            self._marks[name] = time.perf_counter()

    def now(self):
        return time.perf_counter() if self.enabled else None

    tr._StepTimer.mark = mark
    tr._StepTimer.now = now
    ckpt.get_current_device = lambda: "cpu"  # 4


def patch_muon_ns_fp32() -> None:
    """Optional 5th patch: torch.optim.Muon runs its Newton-Schulz iterations in bfloat16
    (`grad.bfloat16()` in torch/optim/_muon.py). A CPU without native bf16 (AVX2 only) takes
    ~25 s per step for it; this runs the identical iteration in float32 instead (more precise,
    same algorithm, ~1 s)."""
    import torch
    import torch.optim._muon as muon

    orig = muon._zeropower_via_newtonschulz

    def ns_fp32(grad, ns_coefficients, ns_steps, eps):
        if len(grad.shape) != 2 or len(ns_coefficients) != 3 or ns_steps >= 100:
            return orig(grad, ns_coefficients, ns_steps, eps)  # let torch raise its own errors
        a, b, c = ns_coefficients
        x = grad.float()
        if grad.size(0) > grad.size(1):
            x = x.T
        x = x / x.norm().clamp(min=eps)
        for _ in range(ns_steps):
            gram = x @ x.T
            upd = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.addmm(x, upd, x, beta=a)
        if grad.size(0) > grad.size(1):
            x = x.T
        return x.to(torch.bfloat16)  # same output dtype as torch's version

    muon._zeropower_via_newtonschulz = ns_fp32


def build_argv(a: argparse.Namespace, extra: list[str]) -> list[str]:
    argv = [
        "--speculator-type", "eagle3",
        "--verifier-name-or-path", a.verifier,
        "--data-path", a.data,
        "--save-path", a.save_path,
        "--log-dir", a.log_dir or os.path.join(a.save_path, "logs"),
        "--epochs", str(a.epochs),
        "--lr", str(a.lr),
        "--seed", str(a.seed),
        "--ttt-steps", str(a.ttt_steps),
        "--draft-vocab-size", str(a.draft_vocab_size),
        "--num-layers", str(a.num_layers),
        "--target-layer-ids", *[str(i) for i in a.target_layer_ids],
        "--norm-before-fc" if a.norm_before_fc else "--no-norm-before-fc",
        "--norm-output" if a.norm_output else "--no-norm-output",
        "--norm-before-residual" if a.norm_before_residual else "--no-norm-before-residual",
        "--hidden-states-dtype", a.hidden_states_dtype,
        "--total-seq-len", str(a.total_seq_len),
        # CPU necessities
        "--loss-implementation", "eager",
        "--draft-attn-impl", "sdpa",
        "--num-workers", "0",
        "--on-missing", "raise",
    ]
    if a.max_steps is not None:
        argv += ["--max-steps", str(a.max_steps)]
    return argv + extra


def main() -> None:
    argv = sys.argv[1:]
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description="speculators 0.9.0 EAGLE-3 training on the CPU")
    p.add_argument("--data", required=True, help="converted data folder (convert.py)")
    p.add_argument("--verifier", required=True, help="HF folder of the target")
    p.add_argument("--save-path", required=True)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--epochs", type=int, default=20)  # speculators default 20
    p.add_argument("--lr", type=float, default=1e-3)  # speculators default 1e-3 (Muon lr defaults to it)
    p.add_argument("--seed", type=int, default=42)  # speculators default 42
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--draft-vocab-size", type=int, default=8192)
    p.add_argument("--num-layers", type=int, default=1)
    # our aux layers 1, 14, 26 (output of layer i) are vLLM/speculators ids i + 1
    p.add_argument("--target-layer-ids", type=int, nargs=3, default=[2, 15, 27])
    bo = argparse.BooleanOptionalAction
    p.add_argument("--norm-before-fc", action=bo, default=True)  # eagle3 default True
    p.add_argument("--norm-output", action=bo, default=True)  # eagle3 default True
    p.add_argument("--norm-before-residual", action=bo, default=True)  # speculators default True (ours: False)
    p.add_argument("--hidden-states-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--total-seq-len", type=int, default=8192)  # tokens packed per step (speculators default)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--muon-ns-fp32", action=bo, default=True,
                   help="run Muon's Newton-Schulz in float32 (CPU speed; torch's default is bfloat16)")
    a = p.parse_args(argv)
    # absolute paths: the verifier path is written into the checkpoint's config.json
    a.data, a.verifier, a.save_path = (os.path.abspath(x) for x in (a.data, a.verifier, a.save_path))

    import torch

    torch.set_num_threads(a.threads)
    apply_cpu_patches()
    if a.muon_ns_fp32:
        patch_muon_ns_fp32()
    from speculators.train.cli import main as spec_main
    from speculators.train.config import TrainConfig

    cfg = TrainConfig.resolve(build_argv(a, extra))
    spec_main(cfg)


if __name__ == "__main__":
    main()
