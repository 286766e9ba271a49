"""Training the EAGLE-3 draft: data order, the optimizer step, schedules, checkpoints and resume.

Owns what makes a training run reproducible and restartable: the batches of an epoch (a pure
function of the round's samples, the seed, the round and the epoch), the optimizer step over a
group of micro-batches (one per process and accumulation slot) with the loss normalised by the
*global* count of counted positions, so that N processes, or one process accumulating N
micro-batches, compute the same update; the learning-rate schedule as a pure function of the step;
and checkpoints (model, optimizer, schedule position, RNG, data position) written atomically as
safetensors + JSON, never pickle.

Promises: killing a run at any moment and restarting it from its last checkpoint replays exactly
the batches an uninterrupted run would have seen after that step, in the same order, from the
same optimizer state, so the result is the same (bitwise on one CPU configuration).
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from storage.datasets import write_folder_atomically
from tasks.model.draft import Eagle3Draft
from tasks.train.muon import Muon, OptimizerPair
from tasks.train.ttt import (Batch, LossPositions, counted_mask, loss_flags, teacher_argmax_in_draft,
                             teacher_targets, ttt_loss)

CHECKPOINT_PREFIX = "step-"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "state.json"
FROZEN = ("embed_tokens.weight",)  # the target's embeddings: reloaded from the target, never saved


# ---------------------------------------------------------------- data order


@dataclass(frozen=True)
class Item:
    """One sample of a round: where it lives (a shard, or "online") and its slot and length there."""

    source: str
    slot: int
    tokens: int


def _seed_of(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256(json.dumps(parts).encode()).digest()[:8], "little") & (2**63 - 1)


def epoch_batches(items: Sequence[Item], seed: int, round_index: int, epoch: int, batch_tokens: int) -> list[list[Item]]:
    """The micro-batches of one epoch: sources in a seeded order, samples shuffled within each source,
    greedily grouped so that batch size x longest sample <= batch_tokens (a longer sample goes alone).

    Batches never span two sources, so a reader holds one shard at a time.
    """
    by_source: dict[str, list[Item]] = {}
    for it in items:
        by_source.setdefault(it.source, []).append(it)
    g = torch.Generator().manual_seed(_seed_of(seed, round_index, epoch))
    sources = sorted(by_source)
    out: list[list[Item]] = []
    for si in torch.randperm(len(sources), generator=g).tolist():
        group = sorted(by_source[sources[si]], key=lambda it: it.slot)
        cur: list[Item] = []
        longest = 0
        for i in torch.randperm(len(group), generator=g).tolist():
            it = group[i]
            if cur and max(longest, it.tokens) * (len(cur) + 1) > batch_tokens:
                out.append(cur)
                cur, longest = [], 0
            cur.append(it)
            longest = max(longest, it.tokens)
        if cur:
            out.append(cur)
    return out


def step_groups(n_batches: int, world_size: int, grad_accum: int) -> int:
    """Optimizer steps in an epoch of `n_batches` micro-batches (a short last group still steps)."""
    per_step = world_size * grad_accum
    return (n_batches + per_step - 1) // per_step


def micro_batch_index(step_in_epoch: int, accum_slot: int, rank: int, world_size: int, grad_accum: int) -> int:
    """Which micro-batch of the epoch a process handles: the same set per step for any (world, accum) split."""
    return step_in_epoch * world_size * grad_accum + accum_slot * world_size + rank


# ---------------------------------------------------------------- schedule


@dataclass(frozen=True)
class Schedule:
    lr: float
    kind: str = "constant"  # constant | cosine | linear
    warmup_steps: int = 0
    total_steps: int | None = None  # the cycle's end (exclusive), in the run's optimizer steps
    min_lr_ratio: float = 0.1
    start_step: int = 0  # the cycle's first step: a cosine restarted for a later round warms up again from here

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step `step` (0-based, counted over the whole run): linear warmup from
        `start_step`, then constant, or a cosine or linear decay down to `min_lr_ratio` at `total_steps`."""
        step = max(step - self.start_step, 0)
        if self.warmup_steps and step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return self.lr
        span = max((self.total_steps or 1) - self.start_step - self.warmup_steps, 1)
        progress = min(max(step - self.warmup_steps, 0) / span, 1.0)
        left = 1 - progress if self.kind == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * left)


# ---------------------------------------------------------------- the optimizer step


@dataclass
class StepMetrics:
    loss: float
    step_loss: list[float]
    accuracy: list[float]
    conditional_accuracy: list[float]
    tokens: int          # trained positions at step 0 (loss-masked tokens trained on)
    grad_norm: float
    lr: float


SPLIT_PADDING = 0.1  # a micro-batch more padded than this runs sample by sample


def unpadded_pieces(batch: Batch, flags: torch.Tensor) -> list[tuple[Batch, torch.Tensor]]:
    """(sub-batch, its argmax-in-draft flags): the micro-batch itself, or each sample cut to its length.

    A sample's loss and gradient do not depend on what it is batched with (right padding, causal
    attention), so running a padded micro-batch sample by sample gives the same sums without the
    model's work on padding positions; a micro-batch with little padding runs whole.
    """
    b, t = batch.input_ids.shape
    lengths = batch.attention_mask.sum(1).tolist()
    if b == 1 or sum(lengths) >= (1 - SPLIT_PADDING) * b * t:
        return [(batch, flags)]
    out = []
    for i, n in enumerate(lengths):
        def cut(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x[i:i + 1, :n]
        piece = Batch(input_ids=cut(batch.input_ids), attention_mask=cut(batch.attention_mask),
                      loss_mask=cut(batch.loss_mask), aux_hidden=cut(batch.aux_hidden),
                      lengths=batch.lengths[i:i + 1], teacher=batch.teacher, final_hidden=cut(batch.final_hidden),
                      topk_ids=cut(batch.topk_ids), topk_logprobs=cut(batch.topk_logprobs),
                      argmax_in_draft=cut(batch.argmax_in_draft), indices=batch.indices[i:i + 1])
        out.append((piece, flags[i:i + 1, :n]))
    return out


def train_step(draft: Eagle3Draft, optimizer: torch.optim.Optimizer, micro: Sequence[Batch | None],
               fallback: Batch | None = None, *, ttt_steps: int, decay: float, target_head: torch.Tensor | None,
               lr: float, grad_clip: float, precision: str = "fp32",
               all_reduce: Callable[[torch.Tensor], None] | None = None,
               loss_positions: LossPositions = "argmax_in_draft") -> StepMetrics:
    """One optimizer step over this process's micro-batches (None: no batch in this slot).

    Every step of TTT is normalised by the count of its trained positions over *all* micro-batches
    of all processes, so the summed gradient is the gradient of one big batch. A None slot adds
    nothing (its gradient is zero; `fallback` is accepted for older callers and not run), and every
    process makes the same collective calls whatever its slots hold.

    Teachers are built one micro-batch at a time: the counting pass needs only each micro-batch's
    argmax-in-draft flags (the first real micro-batch's whole teacher is kept from it, the others'
    draft-vocab distributions are built again just before their forward), so at most one [B, T,
    draft_vocab] teacher is alive at a time. A micro-batch with more than 10% padding runs sample
    by sample (`unpadded_pieces`): the same sums, no work on padding.
    """
    del fallback
    device = draft.d2t.device
    params = [p for p in draft.parameters() if p.requires_grad]
    batches = [b.to(device) if b is not None else None for b in micro]
    counts = torch.zeros(ttt_steps, dtype=torch.float64)
    kept: tuple[int, object] | None = None  # (slot, teacher) of the first real micro-batch
    flags: list[torch.Tensor | None] = []
    for j, b in enumerate(batches):
        if b is None:
            flags.append(None)
            continue
        if kept is None and len(unpadded_pieces(b, b.attention_mask)) == 1:
            teacher = teacher_targets(b, draft, target_head, trained_only=True)
            kept = (j, teacher)
            flag = teacher.argmax_in_draft
        else:
            flag = teacher_argmax_in_draft(b, draft, target_head, trained_only=True)
        flags.append(flag)
        trained = loss_flags(flag, b.attention_mask, loss_positions)
        for i in range(ttt_steps):
            counts[i] += float(counted_mask(b.loss_mask, trained, i).sum())
    if all_reduce is not None:
        all_reduce(counts)
    weights = torch.tensor([decay ** i for i in range(ttt_steps)], dtype=torch.float64)
    scale = (weights / counts.clamp_min(1)).float().to(device)
    # loss sums, trained, valid, correct, cond valid, cond correct
    totals = torch.zeros(6, ttt_steps, dtype=torch.float64)
    optimizer.zero_grad(set_to_none=False)
    for j, b in enumerate(batches):
        if b is None:
            continue
        for piece, flag in unpadded_pieces(b, flags[j]):
            if kept is not None and kept[0] == j:
                t = kept[1]
                kept = None
            else:
                t = teacher_targets(piece, draft, target_head, trained_only=True, argmax_in_draft=flag)
            autocast = torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16" else nullcontext()
            with autocast:
                r = ttt_loss(draft, piece, steps=ttt_steps, decay=decay, teacher=t,  # type: ignore[arg-type]
                             loss_positions=loss_positions)
            del t
            sums = r.step_loss * r.trained.to(r.step_loss.dtype)  # per-step sums of soft cross entropy
            (sums * scale).sum().backward()
            totals += torch.stack([sums.detach().double().cpu(), r.trained.double().cpu(), r.valid.double().cpu(),
                                   r.correct.double().cpu(), r.conditional_valid.double().cpu(),
                                   r.conditional_correct.double().cpu()])
    for p in params:  # a process whose slots were all empty still takes part in the reduction
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if all_reduce is not None:
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        all_reduce(flat)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n
        all_reduce(totals)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, grad_clip))
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    loss_sums, trained_n, valid, correct, cond_valid, cond_correct = totals
    return StepMetrics(
        loss=float((weights * loss_sums / trained_n.clamp_min(1)).sum()),
        step_loss=(loss_sums / trained_n.clamp_min(1)).tolist(),
        accuracy=(correct / valid.clamp_min(1)).tolist(),
        conditional_accuracy=(cond_correct / cond_valid.clamp_min(1)).tolist(),
        tokens=int(trained_n[0]), grad_norm=grad_norm, lr=lr)


def make_optimizer(draft: Eagle3Draft, lr: float, weight_decay: float,
                   kind: str = "adamw") -> torch.optim.Optimizer | OptimizerPair:
    """AdamW over every trained parameter, or (`muon`) Muon over the hidden matrices (fc, attention, MLP) and AdamW
    over the rest (norms, lm_head), speculators' split: Muon is for matrices inside the network, not for a
    vocabulary's rows."""
    named = [(n, p) for n, p in draft.named_parameters() if p.requires_grad]
    # foreach=False: the per-parameter kernels give the same bits whatever the parameter grouping
    adamw = dict(lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95), foreach=False)
    if kind == "adamw":
        return torch.optim.AdamW([p for _, p in named], **adamw)
    if kind != "muon":
        raise ValueError(f"unknown optimizer {kind!r} (adamw, muon)")
    hidden = [p for n, p in named if p.ndim == 2 and min(p.shape) > 1 and not n.startswith(("lm_head", "embed_tokens"))]
    ids = {id(p) for p in hidden}
    rest = [p for _, p in named if id(p) not in ids]
    return OptimizerPair([Muon(hidden, lr=lr, weight_decay=weight_decay)]
                         + ([torch.optim.AdamW(rest, **adamw)] if rest else []))


# ---------------------------------------------------------------- checkpoints


@dataclass
class DataPosition:
    """Where an unfinished round stands: its shards, the epoch, the optimizer steps done in it."""

    round_index: int
    shards: list[str]
    epoch: int = 0
    step_in_epoch: int = 0


@dataclass
class TrainState:
    step: int = 0
    tokens: int = 0
    rounds_done: int = 0
    trained_shards: list[str] = field(default_factory=list)  # shards of completed rounds
    position: DataPosition | None = None
    # A cosine schedule the run chose itself (train.total_steps unset): the current round's cycle, from the step
    # the round began at to the end of its last epoch. Checkpoints before per-round cycles lack lr_start: 0.
    lr_horizon: int | None = None
    lr_start: int = 0

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> TrainState:
        pos = d.get("position")
        return cls(step=d["step"], tokens=d["tokens"], rounds_done=d["rounds_done"],
                   trained_shards=list(d["trained_shards"]), position=DataPosition(**pos) if pos else None,
                   lr_horizon=d.get("lr_horizon"), lr_start=d.get("lr_start", 0))


def checkpoint_dir(root: Path, step: int) -> Path:
    return root / f"{CHECKPOINT_PREFIX}{step:08d}"


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first (a folder appears only by an atomic rename)."""
    if not root.exists():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX)
                  and (p / STATE_FILE).is_file())


def model_weights(draft: Eagle3Draft) -> dict[str, torch.Tensor]:
    """The draft's tensors as a checkpoint saves them: all but the frozen target embeddings."""
    return {k: v.detach().contiguous() for k, v in draft.state_dict().items() if k not in FROZEN}


def load_model_weights(draft: Eagle3Draft, path: Path, where: Path) -> None:
    """Load `model_weights` saved at `path` into `draft`; refuses keys that do not fit it (`where` names the folder)."""
    missing, unexpected = draft.load_state_dict(load_file(path), strict=False)
    missing = [k for k in missing if k not in FROZEN]
    if missing or unexpected:
        raise ValueError(f"{where}: checkpoint keys do not fit the draft (missing {missing}, unexpected {unexpected})")


def save_checkpoint(root: Path, draft: Eagle3Draft, optimizer: torch.optim.Optimizer, state: TrainState,
                    identity: dict, keep: int) -> Path:
    """Write a checkpoint of the run at `state.step`; older ones beyond `keep` are removed."""
    folder = checkpoint_dir(root, state.step)
    model = model_weights(draft)
    opt = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {"rng.torch": torch.get_rng_state()}
    for idx, st in opt["state"].items():
        for name, value in st.items():
            tensors[f"state.{idx}.{name}"] = torch.as_tensor(value).detach().contiguous()
    groups = [{k: v for k, v in g.items()} for g in opt["param_groups"]]

    def write(tmp: Path) -> None:
        save_file(model, tmp / MODEL_FILE)
        save_file(tensors, tmp / OPTIMIZER_FILE)
        (tmp / STATE_FILE).write_text(json.dumps({"state": state.to_json(), "param_groups": groups,
                                                  "identity": identity}, indent=1, sort_keys=True))

    if folder.exists():  # the same step again (a resumed run that redid it): identical by construction
        shutil.rmtree(folder)
    write_folder_atomically(folder, write)
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return folder


def load_checkpoint(folder: Path, draft: Eagle3Draft, optimizer: torch.optim.Optimizer, identity: dict) -> TrainState:
    """Restore model, optimizer and RNG from `folder`; refuses one written for another draft or data."""
    meta = json.loads((folder / STATE_FILE).read_text())
    stored = meta["identity"]
    diff = sorted(k for k in set(stored) | set(identity) if stored.get(k) != identity.get(k))
    if diff:
        raise ValueError(f"{folder} belongs to another training setup (differs in {', '.join(diff)}); "
                         "use another run_name for a new run")
    load_model_weights(draft, folder / MODEL_FILE, folder)
    tensors = load_file(folder / OPTIMIZER_FILE)
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith("state."):
            _, idx, name = key.split(".", 2)
            state.setdefault(int(idx), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    torch.set_rng_state(tensors["rng.torch"])
    return TrainState.from_json(meta["state"])


def weights_sha256(folder: Path) -> str:
    from storage.datasets import file_sha256

    return file_sha256(folder / MODEL_FILE)
