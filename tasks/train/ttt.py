"""Training-time test: the batches the draft trains on, the teacher, and the TTT loss with its metrics.

Owns `collate` (extract records -> right-padded `Batch`), the teacher (`teacher_targets`: the
target's distribution over the draft vocab at every position, from the final state or the stored
top-k) and `ttt_loss` (per-step soft cross entropy and the accuracy / conditional accuracy that
predict acceptance). The alignment it trains (which token and teacher each TTT step at each
position reads and predicts) is stated once, in tasks/model/draft.py's docstring; the model lives
there too.

Promises: the loss is forward KL as soft cross entropy over the draft vocab, mean over trained
positions per step, steps weighted decay**i; the teacher is float32; the teacher, the head and
the soft cross entropy are computed only at trained positions (the same numbers as over all
positions, masked). Trained positions are the counted ones (the target's argmax is a draft token)
or, with `loss_positions="all"` (speculators' choice), every loss-masked one; the metrics always
count only the counted positions, where a draft token can be accepted. Conditional accuracy at
step i counts a position only when steps < i were counted and right there
(tests/test_ttt_metrics.py replays a verifier against it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from tasks.model.draft import DEFAULT_STEP_DECAY, DEFAULT_TTT_STEPS, Eagle3Draft, Teacher, shift_left
from tasks.extract.hf_backend import Extracted, aux_hidden_float


# ---------------------------------------------------------------- batches and teachers

@dataclass
class Batch:
    """Right-padded records. Teacher tensors are set for exactly one teacher kind."""

    input_ids: torch.Tensor        # int64 [B, T], pad_token_id past each length
    attention_mask: torch.Tensor   # bool [B, T]
    loss_mask: torch.Tensor        # bool [B, T], False on padding
    aux_hidden: torch.Tensor       # float [B, T, 3H], zero on padding
    lengths: torch.Tensor          # int64 [B]
    teacher: Teacher
    final_hidden: torch.Tensor | None = None     # float [B, T, H] post-norm target states
    topk_ids: torch.Tensor | None = None         # int64 [B, T, k] target ids
    topk_logprobs: torch.Tensor | None = None    # float32 [B, T, k], -inf on padding
    argmax_in_draft: torch.Tensor | None = None  # bool [B, T] (topk teacher)
    indices: list[int] = field(default_factory=list)

    def to(self, device: torch.device | str) -> Batch:
        moved = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return Batch(**moved)


def collate(records: Sequence[Extracted], pad_token_id: int = 0, dtype: torch.dtype = torch.float32) -> Batch:
    """Right-pad extract records into one `Batch` (aux states dequantised to `dtype`, fp8 included)."""
    if not records:
        raise ValueError("collate needs at least one record")
    kinds = {"final_hidden" if r.final_hidden is not None else "topk" if r.topk_ids is not None else None
             for r in records}
    if None in kinds:
        raise ValueError("a record has no teacher (neither final_hidden nor topk_ids)")
    if len(kinds) > 1:
        raise ValueError("records mix the final_hidden and topk teachers; batch them separately")
    teacher: Teacher = kinds.pop()  # type: ignore[assignment]
    widths = {r.aux_hidden.shape[-1] for r in records}
    if len(widths) > 1:
        raise ValueError(f"records have different aux widths {sorted(widths)}: they come from different targets")
    lengths = [int(r.input_ids.shape[0]) for r in records]
    for r, n in zip(records, lengths):
        if r.loss_mask.shape[0] != n or r.aux_hidden.shape[0] != n:
            raise ValueError(f"record {r.index}: input_ids, loss_mask and aux_hidden lengths differ")
    b, t = len(records), max(lengths)
    out = Batch(input_ids=torch.full((b, t), pad_token_id, dtype=torch.int64),
                attention_mask=torch.zeros(b, t, dtype=torch.bool), loss_mask=torch.zeros(b, t, dtype=torch.bool),
                aux_hidden=torch.zeros(b, t, widths.pop(), dtype=dtype), lengths=torch.tensor(lengths),
                teacher=teacher, indices=[r.index for r in records])
    if teacher == "final_hidden":
        out.final_hidden = torch.zeros(b, t, records[0].final_hidden.shape[-1], dtype=dtype)
    else:
        k = {r.topk_ids.shape[-1] for r in records}
        if len(k) > 1 or any(r.argmax_in_draft is None or r.topk_logprobs is None for r in records):
            raise ValueError("topk records must share k and carry topk_logprobs and argmax_in_draft")
        k_ = k.pop()
        out.topk_ids = torch.zeros(b, t, k_, dtype=torch.int64)
        out.topk_logprobs = torch.full((b, t, k_), float("-inf"), dtype=torch.float32)
        out.argmax_in_draft = torch.zeros(b, t, dtype=torch.bool)
    for i, (r, n) in enumerate(zip(records, lengths)):
        out.input_ids[i, :n] = r.input_ids.long()
        out.attention_mask[i, :n] = True
        out.loss_mask[i, :n] = r.loss_mask.bool()
        out.aux_hidden[i, :n] = aux_hidden_float(r).to(dtype)
        if teacher == "final_hidden":
            out.final_hidden[i, :n] = r.final_hidden.to(dtype)
        else:
            out.topk_ids[i, :n] = r.topk_ids.long()
            out.topk_logprobs[i, :n] = r.topk_logprobs.float()
            out.argmax_in_draft[i, :n] = r.argmax_in_draft.bool()
    return out


@dataclass
class TeacherTargets:
    probs: torch.Tensor            # float32 [B, T, draft_vocab]: target distribution restricted to the draft vocab
    argmax_in_draft: torch.Tensor  # bool [B, T]: the target's full-vocab argmax is a draft token
    # float32 [B, T + extra, draft_vocab]: `probs` followed by zero rows (`probs` is a view of it), so
    # the teacher of position t+n is a view, not a copy
    rows: torch.Tensor | None = field(default=None, repr=False)
    argmax: torch.Tensor | None = field(default=None, repr=False)  # int64 [B, T]: probs.argmax(-1)

    def shifted(self, n: int) -> torch.Tensor:
        """probs at t+n at position t (zeros past the end), [B, T, draft_vocab]; a view when `rows` allows."""
        t = self.probs.shape[1]
        if self.rows is not None and n >= 0 and self.rows.shape[1] >= t + n:
            return self.rows[:, n:n + t]
        return shift_left(self.probs, n)

    def teacher_argmax(self) -> torch.Tensor:
        if self.argmax is None:
            self.argmax = self.probs.argmax(-1)
        return self.argmax


def trained_teacher_positions(batch: Batch) -> torch.Tensor:
    """bool [B, T]: the positions u whose teacher any TTT step can count (token u+1 is loss-masked)."""
    return shift_left(batch.loss_mask.bool(), 1, False) & batch.attention_mask.bool()


def _draft_max_beats_rest(x: torch.Tensor, d_max: torch.Tensor, d_tid: torch.Tensor, head: torch.Tensor,
                          draft: Eagle3Draft, chunk_tokens: int, block_rows: int) -> torch.Tensor:
    """bool [N]: the first index of the maximum of the full-vocab logits x @ head.T is a draft token.

    The same boolean as `draft.t2d[(x @ head.T).argmax(-1)]` (argmax: the first maximal index),
    without the full [N, V] logits: given the draft ids' maximum logit `d_max` and the target id
    `d_tid` of its first occurrence, the other ids' logits are computed in blocks of head rows
    (float32, the same dot products) keeping their running maximum and its first (lowest) target
    id. Draft ids are in ascending target-id order (validate_vocab), so a tie goes to the lower id.
    """
    device = x.device
    n = x.shape[0]
    others = (~draft.t2d).nonzero().squeeze(1)
    best = torch.full((n,), float("-inf"), dtype=torch.float32, device=device)
    best_tid = torch.full((n,), draft.config.target_vocab_size, dtype=torch.int64, device=device)
    for r0 in range(0, others.numel(), block_rows):
        ids = others[r0:r0 + block_rows]
        w = head[ids.to(head.device)].to(device, torch.float32)
        for c0 in range(0, n, chunk_tokens):
            logits = x[c0:c0 + chunk_tokens] @ w.T
            a = logits.argmax(-1)
            m = logits.gather(1, a[:, None]).squeeze(1)
            seg = slice(c0, c0 + chunk_tokens)
            better = m > best[seg]  # strict: an earlier block holds lower ids
            best[seg] = torch.where(better, m, best[seg])
            best_tid[seg] = torch.where(better, ids[a], best_tid[seg])
    return (d_max > best) | ((d_max == best) & (d_tid < best_tid))


def _final_hidden_teacher(batch: Batch, draft: Eagle3Draft, target_head: torch.Tensor | None, chunk_tokens: int,
                          trained_only: bool, want_probs: bool, argmax_in_draft: torch.Tensor | None,
                          extra_rows: int, block_rows: int) -> TeacherTargets:
    b, t = batch.input_ids.shape
    n_draft = draft.config.draft_vocab_size
    device = draft.d2t.device
    if target_head is None:
        raise ValueError("the final_hidden teacher needs target_head, the target's lm_head weight [V, H]")
    v = draft.config.target_vocab_size
    if target_head.shape != (v, draft.config.hidden_size):
        raise ValueError(f"target_head has shape {tuple(target_head.shape)}, "
                         f"expected ({v}, {draft.config.hidden_size})")
    head = target_head.detach()
    draft_ids = draft.draft_to_target
    head_draft = head[draft_ids.to(head.device)].to(device, torch.float32)
    where = trained_teacher_positions(batch) if trained_only else torch.ones(b, t, dtype=torch.bool)
    bi, ti = where.to(device).nonzero(as_tuple=True)
    x = batch.final_hidden.to(device)[bi, ti].to(torch.float32)
    n = x.shape[0]
    rows = torch.zeros(b, t + extra_rows, n_draft if want_probs else 0, dtype=torch.float32, device=device)
    rows_flat = rows.view(b * (t + extra_rows), rows.shape[-1])
    flat = bi * (t + extra_rows) + ti
    argmax = torch.zeros(b, t, dtype=torch.int64, device=device)
    d_max = torch.empty(n, dtype=torch.float32, device=device)
    d_tid = torch.empty(n, dtype=torch.int64, device=device)
    for c0 in range(0, n, chunk_tokens):
        seg = slice(c0, c0 + chunk_tokens)
        logits = x[seg] @ head_draft.T
        a = logits.argmax(-1)
        d_max[seg] = logits.gather(1, a[:, None]).squeeze(1)
        d_tid[seg] = draft_ids[a]
        if want_probs:
            p = logits.softmax(dim=-1)
            rows_flat[flat[seg]] = p
            argmax[bi[seg], ti[seg]] = p.argmax(-1)
    if argmax_in_draft is None:
        in_draft = torch.zeros(b, t, dtype=torch.bool, device=device)
        in_draft[bi, ti] = _draft_max_beats_rest(x, d_max, d_tid, head, draft, chunk_tokens, block_rows)
    else:
        in_draft = argmax_in_draft.to(device).bool()
    return TeacherTargets(rows[:, :t], in_draft, rows, argmax)


@torch.no_grad()
def teacher_targets(batch: Batch, draft: Eagle3Draft, target_head: torch.Tensor | None = None,
                    chunk_tokens: int = 512, *, trained_only: bool = False,
                    argmax_in_draft: torch.Tensor | None = None, extra_rows: int = DEFAULT_TTT_STEPS + 1,
                    block_rows: int = 8192) -> TeacherTargets:
    """The teacher at every position of `batch`, over the draft vocab (draft id order).

    final_hidden: logits = final_hidden @ target_head.T in float32 (target_head: the target's
    lm_head weight [V, H]), softmax over the draft ids, argmax over the full vocab. The draft ids'
    logits and the other ids' are separate matmuls over row subsets of the head (the same float32
    dot products), the full-vocab argmax is decided from the two maxima and their first ids, and
    positions go in chunks, so a 160K-vocab target never needs B*T*V floats at once.
    topk: the stored log-probs (already renormalised over the draft vocab) scattered into a dense
    draft-vocab distribution and renormalised over the k kept tokens, so every counted position
    holds a distribution.

    trained_only: compute only the positions a TTT step can count (`trained_teacher_positions`);
    elsewhere probs are 0 and argmax_in_draft False, which the loss, the counts and the metrics
    never read. argmax_in_draft: the final_hidden flags when already known (train_step's counting
    pass): the head's non-draft rows are then not needed. The probs are a view of `rows`, which has
    `extra_rows` zero rows at the end of each sample, so shifted teachers are views.
    """
    if batch.teacher == "final_hidden":
        return _final_hidden_teacher(batch, draft, target_head, chunk_tokens, trained_only, True, argmax_in_draft,
                                     extra_rows, block_rows)
    b, t = batch.input_ids.shape
    device = draft.d2t.device
    rows = torch.zeros(b, t + extra_rows, draft.config.draft_vocab_size, dtype=torch.float32, device=device)
    probs = rows[:, :t]
    to_draft = draft.target_to_draft()
    ids = to_draft[batch.topk_ids.to(device)]
    kept = torch.isfinite(batch.topk_logprobs.to(device))
    bad = kept & (ids < 0)
    if bad.any():
        raise ValueError(f"{int(bad.sum())} top-k teacher ids are outside this draft's vocab: the records were "
                         "extracted with another draft vocabulary")
    p = torch.where(kept, batch.topk_logprobs.to(device).exp(), torch.zeros((), device=device))
    probs.scatter_add_(-1, ids.clamp_min(0), p)
    probs.div_(probs.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny))
    return TeacherTargets(probs, batch.argmax_in_draft.to(device) & batch.attention_mask.to(device), rows)


@torch.no_grad()
def teacher_argmax_in_draft(batch: Batch, draft: Eagle3Draft, target_head: torch.Tensor | None = None,
                            chunk_tokens: int = 512, *, trained_only: bool = False,
                            block_rows: int = 8192) -> torch.Tensor:
    """bool [B, T]: `teacher_targets(...).argmax_in_draft` alone (what the counting pass needs), no probs."""
    device = draft.d2t.device
    if batch.teacher != "final_hidden":
        return batch.argmax_in_draft.to(device) & batch.attention_mask.to(device)
    return _final_hidden_teacher(batch, draft, target_head, chunk_tokens, trained_only, False, None, 0,
                                 block_rows).argmax_in_draft


# ---------------------------------------------------------------- the TTT loss

class _SoftCrossEntropy(torch.autograd.Function):
    """Per row n: -(p_n * log_softmax(z_n)).sum() = sum(p_n) * logsumexp(z_n) - p_n . z_n, in float32.

    p_n = rows[index[n]] (the teacher buffer, not differentiated). Keeps z (the logits) and two
    floats per row for backward, not log-probabilities nor a copy of p: the backward is
    g * (sum(p) * softmax(z) - p), with p gathered again.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        with torch.autocast(logits.device.type, enabled=False):
            z = logits.float()
            p = rows.index_select(0, index)
            lse = torch.logsumexp(z, dim=-1)
            psum = p.sum(-1)
            pz = torch.bmm(z.unsqueeze(1), p.unsqueeze(2)).view(-1)
        ctx.save_for_backward(logits, rows, index, lse, psum)
        return psum * lse - pz

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, rows, index, lse, psum = ctx.saved_tensors
        g = grad.float()
        out = (logits.float() - lse[:, None]).exp_()
        out.mul_((g * psum)[:, None])
        out.sub_(rows.index_select(0, index).mul_(g[:, None]))
        return out.to(logits.dtype), None, None


@dataclass
class TTTResult:
    """Per-step numbers of one batch. Counts let a trainer aggregate over batches (sum, then divide)."""

    loss: torch.Tensor                 # scalar, sum_i decay**i * step_loss[i]; differentiable
    step_loss: torch.Tensor            # [k] mean soft cross entropy over trained positions; differentiable
    sample_loss: torch.Tensor          # [B, k] the same per sample (0 where a sample has no trained position)
    trained: torch.Tensor              # int64 [k] trained positions (the loss's denominator)
    valid: torch.Tensor                # int64 [k] counted positions (the metrics' denominator)
    correct: torch.Tensor              # int64 [k] counted positions where draft argmax == teacher argmax
    conditional_valid: torch.Tensor    # int64 [k] counted positions whose steps < i were all counted and correct
    conditional_correct: torch.Tensor  # int64 [k] those that are correct at step i too
    weights: tuple[float, ...]

    @property
    def accuracy(self) -> torch.Tensor:
        return self.correct.double() / self.valid.clamp_min(1).double()

    @property
    def conditional_accuracy(self) -> torch.Tensor:
        """Step i correct given steps < i correct at that position: what predicts acceptance."""
        return self.conditional_correct.double() / self.conditional_valid.clamp_min(1).double()


# Which teacher positions the loss trains on: those whose target argmax is a draft token (ours: elsewhere the
# draft can never be accepted), or every loss-masked position toward the target's distribution renormalised over the
# draft vocab (speculators').
LossPositions = Literal["argmax_in_draft", "all"]


def loss_flags(argmax_in_draft: torch.Tensor, attention_mask: torch.Tensor,
               loss_positions: LossPositions = "argmax_in_draft") -> torch.Tensor:
    """bool [B, T]: the teacher positions the loss may train on (`counted_mask`'s second argument)."""
    if loss_positions == "argmax_in_draft":
        return argmax_in_draft
    if loss_positions == "all":
        return attention_mask.to(argmax_in_draft.device).bool()
    raise ValueError(f"unknown loss_positions {loss_positions!r} (argmax_in_draft, all)")


def counted_mask(loss_mask: torch.Tensor, argmax_in_draft: torch.Tensor, step: int) -> torch.Tensor:
    """bool [B, T]: the positions TTT `step` counts: token t+step+2 is loss-masked and the target's
    argmax at t+step+1 is a draft token."""
    return (shift_left(loss_mask.bool(), step + 2, False)
            & shift_left(argmax_in_draft.to(loss_mask.device).bool(), step + 1, False))


def step_targets(batch: Batch, teacher: TeacherTargets, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What TTT `step` at position t is trained on: (teacher probs [B, T, draft_vocab], counted bool [B, T]).

    The teacher is the target's distribution at t+step+1 (it predicts token t+step+2); a position
    counts when that token is loss-masked and the target's argmax there is a draft token.
    """
    return teacher.shifted(step + 1), step_valid_mask(batch, teacher, step)


def step_valid_mask(batch: Batch, teacher: TeacherTargets, step: int) -> torch.Tensor:
    """bool [B, T]: the positions TTT `step` counts (the second half of `step_targets`)."""
    return counted_mask(batch.loss_mask.to(teacher.argmax_in_draft.device), teacher.argmax_in_draft, step)


def ttt_loss(draft: Eagle3Draft, batch: Batch, steps: int = DEFAULT_TTT_STEPS, decay: float = DEFAULT_STEP_DECAY,
             target_head: torch.Tensor | None = None, teacher: TeacherTargets | None = None,
             loss_positions: LossPositions = "argmax_in_draft") -> TTTResult:
    """Unroll `steps` TTT steps on `batch` and return the weighted loss and per-step metrics.

    Each step's norm, lm_head and soft cross entropy run on its trained positions only (the others
    reach neither the loss nor the metrics, and no later position reads a step's logits); the
    metrics count the counted positions among them.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    device = draft.d2t.device
    batch = batch.to(device)
    if teacher is None:
        teacher = teacher_targets(batch, draft, target_head, trained_only=True)
    b, t = batch.input_ids.shape
    rows = teacher.rows if teacher.rows is not None and teacher.rows.shape[1] >= t else None
    width = rows.shape[1] if rows is not None else t
    target = teacher.teacher_argmax()
    weights = tuple(decay ** i for i in range(steps))
    step_losses, sample_losses = [], []
    valid_n, correct_n, cvalid_n, ccorrect_n, trained_n = [], [], [], [], []
    flags = loss_flags(teacher.argmax_in_draft, batch.attention_mask, loss_positions)
    chain_ok = torch.ones_like(batch.attention_mask, dtype=torch.bool)  # steps < i all counted and correct
    for i, hidden in enumerate(draft.hidden_steps(batch.aux_hidden, batch.input_ids, batch.attention_mask, steps)):
        valid = step_valid_mask(batch, teacher, i)
        trained = valid if loss_positions == "argmax_in_draft" else counted_mask(batch.loss_mask, flags, i)
        bi, ti = trained.nonzero(as_tuple=True)  # trained positions: token t+i+2 exists, so t+i+1 < T
        logits = draft.lm_head(draft.norm(hidden[bi, ti]))  # [N, draft_vocab]
        if rows is not None:
            ce = _SoftCrossEntropy.apply(logits, rows.view(-1, rows.shape[-1]), bi * width + ti + i + 1)
        else:
            ce = _SoftCrossEntropy.apply(logits, teacher.probs.reshape(-1, teacher.probs.shape[-1]),
                                         bi * t + ti + i + 1)
        per_sample_n = trained.sum(1)
        sample_losses.append(torch.zeros(b, dtype=ce.dtype, device=device).index_add(0, bi, ce)
                             / per_sample_n.clamp_min(1))
        step_losses.append(ce.sum() / per_sample_n.sum().clamp_min(1))
        trained_n.append(per_sample_n.sum())
        with torch.no_grad():
            right = torch.zeros_like(valid)
            right[bi, ti] = logits.argmax(-1) == target[bi, ti + i + 1]
            right &= valid  # a position whose target argmax is no draft token is never right
            cond = chain_ok & valid
            valid_n.append(valid.sum())
            correct_n.append(right.sum())
            cvalid_n.append(cond.sum())
            ccorrect_n.append((cond & right).sum())
            chain_ok = cond & right
    step_loss = torch.stack(step_losses)
    return TTTResult(loss=(step_loss * torch.tensor(weights, device=device)).sum(), step_loss=step_loss,
                     sample_loss=torch.stack(sample_losses, dim=1), trained=torch.stack(trained_n),
                     valid=torch.stack(valid_n),
                     correct=torch.stack(correct_n), conditional_valid=torch.stack(cvalid_n),
                     conditional_correct=torch.stack(ccorrect_n), weights=weights)
