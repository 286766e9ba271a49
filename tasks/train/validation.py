"""Validation inside a training round: the draft's expected acceptance on samples held out of it, and the best draft kept.

Owns choosing a round's validation samples (a fixed number, by seed), measuring the draft on them (the
TTT unrolled without gradients: accuracy and conditional accuracy per step, and the expected
acceptance length they imply), and keeping the round's best draft on disk. Promises: a validation
sample is never trained on in its round; the choice depends only on the seed, the round and the
round's samples, so a resumed run holds out the same ones; the best draft's folder appears only by an
atomic rename, with its measurement beside its weights, so a resumed run knows the best so far
without any other state.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from storage.datasets import write_folder_atomically
from tasks.extract.hf_backend import Extracted
from tasks.model.draft import Eagle3Draft
from tasks.train.steps import Item, load_model_weights, model_weights
from tasks.train.ttt import collate, ttt_loss

BEST_MODEL = "model.safetensors"
BEST_INFO = "validation.json"


@dataclass
class Validation:
    step: int
    epoch: int
    samples: int
    positions: int                      # counted positions at step 0
    accuracy: list[float]               # per TTT step
    conditional_accuracy: list[float]   # step i correct given steps < i correct
    expected_acceptance: float          # 1 + sum over i of prod_{j<=i} conditional_accuracy[j]

    def to_json(self) -> dict:
        return asdict(self)


def expected_acceptance(conditional_accuracy: list[float]) -> float:
    """The acceptance length a chain of these per-step conditional accuracies gives: the bonus token plus
    the expected run of accepted draft tokens. An upper bound of what a server sees, since positions whose
    target token lies outside the draft vocab are not counted; used to rank drafts of one run, not as a
    serving figure."""
    total, run = 1.0, 1.0
    for c in conditional_accuracy:
        run *= c
        total += run
    return total


def split_validation(items: list[Item], n: int, seed: int, round_index: int) -> tuple[list[Item], list[Item]]:
    """(training items, validation items): `n` of the round's samples held out, chosen by a hash of the seed,
    the round and each sample's place (its shard and slot), so the choice does not depend on item order."""
    if n == 0:
        return list(items), []
    if n >= len(items):
        raise ValueError(f"train.validation_samples={n} leaves nothing to train on in round {round_index} "
                         f"({len(items)} samples)")

    def rank(it: Item) -> bytes:
        return hashlib.sha256(f"{seed}/{round_index}/{it.source}/{it.slot}".encode()).digest()

    held = set(sorted(range(len(items)), key=lambda i: rank(items[i]))[:n])
    return ([it for i, it in enumerate(items) if i not in held],
            [it for i, it in enumerate(items) if i in held])


def validation_batches(records: list[Extracted], batch_tokens: int) -> list[list[Extracted]]:
    """The validation records in micro-batches of at most `batch_tokens` padded tokens (longest first, so
    padding stays small); a record longer than the budget is a batch of its own."""
    out: list[list[Extracted]] = []
    current: list[Extracted] = []
    longest = 0
    for r in sorted(records, key=lambda r: -len(r.input_ids)):
        n = len(r.input_ids)
        if current and max(longest, n) * (len(current) + 1) > batch_tokens:
            out.append(current)
            current, longest = [], 0
        current.append(r)
        longest = max(longest, n)
    if current:
        out.append(current)
    return out


@torch.no_grad()
def validate(draft: Eagle3Draft, batches: list[list[Extracted]], *, ttt_steps: int, target_head: torch.Tensor,
             step: int, epoch: int) -> Validation:
    """The draft's per-step accuracies on the validation batches, summed over positions, and the expected
    acceptance they imply. The draft is put in eval mode for the pass and restored after."""
    was_training = draft.training
    draft.eval()
    totals = torch.zeros(4, ttt_steps, dtype=torch.float64)  # valid, correct, conditional valid, conditional correct
    samples = 0
    try:
        for records in batches:
            r = ttt_loss(draft, collate(records), steps=ttt_steps, target_head=target_head)
            totals += torch.stack([r.valid.double().cpu(), r.correct.double().cpu(),
                                   r.conditional_valid.double().cpu(), r.conditional_correct.double().cpu()])
            samples += len(records)
    finally:
        draft.train(was_training)
    conditional = (totals[3] / totals[2].clamp_min(1)).tolist()
    return Validation(step=step, epoch=epoch, samples=samples, positions=int(totals[0][0]),
                      accuracy=(totals[1] / totals[0].clamp_min(1)).tolist(), conditional_accuracy=conditional,
                      expected_acceptance=expected_acceptance(conditional))


def best_folders(ckpt_root: Path, round_index: int) -> list[Path]:
    """The round's kept drafts, oldest first; normally one (two only after a kill between writing a better
    one and removing the one it replaced: each is kept only when better, so the newest is the best)."""
    if not ckpt_root.exists():
        return []
    prefix = f"best-round-{round_index:04d}-step-"
    return sorted(p for p in ckpt_root.iterdir() if p.is_dir() and p.name.startswith(prefix)
                  and (p / BEST_INFO).is_file())


def read_best(ckpt_root: Path, round_index: int) -> Validation | None:
    """The round's best validation so far (None before the first)."""
    folders = best_folders(ckpt_root, round_index)
    return Validation(**json.loads((folders[-1] / BEST_INFO).read_text())) if folders else None


def keep_if_best(ckpt_root: Path, round_index: int, draft: Eagle3Draft, v: Validation) -> bool:
    """Save the draft as the round's best when `v` beats the best so far (ties keep the earlier draft);
    the folder it replaces is removed only once the new one is in place. True when the draft of `v`'s step is the
    kept one, including a step validated again after a resume whose draft was kept before the stop."""
    best = read_best(ckpt_root, round_index)
    if best is not None and best.step == v.step:  # the same step validated again after a resume: its draft is kept
        return True
    if best is not None and v.expected_acceptance <= best.expected_acceptance:
        return False
    weights = model_weights(draft)

    def write(tmp: Path) -> None:
        save_file(weights, tmp / BEST_MODEL)
        (tmp / BEST_INFO).write_text(json.dumps(v.to_json(), indent=1))

    folder = ckpt_root / f"best-round-{round_index:04d}-step-{v.step:08d}"
    if folder.exists():  # written before a kill that left the folder it replaces (best_folders)
        return True
    write_folder_atomically(folder, write)
    for old in best_folders(ckpt_root, round_index):
        if old != folder:
            shutil.rmtree(old, ignore_errors=True)
    return True


def load_best(ckpt_root: Path, round_index: int, draft: Eagle3Draft) -> Validation:
    """Load the round's best weights into `draft` (which holds the frozen embeddings already)."""
    folders = best_folders(ckpt_root, round_index)
    if not folders:
        raise FileNotFoundError(f"{ckpt_root}: no validated draft in round {round_index}")
    load_model_weights(draft, folders[-1] / BEST_MODEL, folders[-1])
    return Validation(**json.loads((folders[-1] / BEST_INFO).read_text()))
