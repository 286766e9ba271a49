"""The fast TTT training path computes what the previous one did.

The reference is the code of commit c56fe19 (before the fused attention, the split teacher and the
fused soft cross entropy), kept here verbatim where it matters: the dense-score `ttt_attention`, the
full-vocab `teacher_targets`, the shift-copy `ttt_loss` and `train_step` that builds every teacher
first. Compared on real SmolLM2 states of real chats (float32): attention outputs and gradients,
the teacher (the argmax-in-draft flags bit for bit), losses, metrics and gradients to 1e-5, and the
weights after several optimizer steps. Also: no attention-sized tensor is kept for backward, and
the portable (non-fused) attention path gives the same numbers.
"""

from __future__ import annotations

import contextlib
import math
import tempfile
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import tasks.model.draft as dm
from tasks.model.attention import ttt_attention, ttt_attention_mask
from tasks.model.draft import DraftConfig, Eagle3Draft, shift_left, load_target_embeddings, target_head_weight
from tasks.train.ttt import Batch, collate, teacher_targets, trained_teacher_positions, ttt_loss
from tasks.train.steps import make_optimizer, train_step

TARGET_CACHE = Path(tempfile.gettempdir()) / "eagle3-test-targets"  # shared with the other test modules
pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---- the reference: commit c56fe19 --------------------------------------------------------------------

def ref_ttt_attention(q: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                      step0_mask: torch.Tensor) -> torch.Tensor:
    b, nh, t, d = q.shape
    kvh = keys[0].shape[1]
    qg = q.view(b, kvh, nh // kvh, t, d)
    scale = 1.0 / math.sqrt(d)
    scores0 = torch.matmul(qg, keys[0].unsqueeze(2).transpose(-1, -2)).float() * scale
    scores0 = scores0.masked_fill(~step0_mask[:, None, None], float("-inf"))
    diag = [(qg * k.unsqueeze(2)).sum(-1, keepdim=True).float() * scale for k in keys[1:]]
    weights = torch.cat([scores0, *diag], dim=-1).softmax(dim=-1).to(q.dtype)
    out = torch.matmul(weights[..., :t], values[0].unsqueeze(2))
    for j, v in enumerate(values[1:]):
        out = out + weights[..., t + j, None] * v.unsqueeze(2)
    return out.view(b, nh, t, d)


def _ref_attention_from_mask(q, keys, values, attention_mask):
    b, t = q.shape[0], q.shape[2]
    real = torch.ones(b, t, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    return ref_ttt_attention(q, keys, values, torch.ones(t, t, dtype=torch.bool).tril()[None] & real[:, None, :])


@contextlib.contextmanager
def reference_attention():
    """The model's attention module calls the reference kernel (the c56fe19 forward) inside."""
    saved = dm.ttt_attention
    dm.ttt_attention = _ref_attention_from_mask
    try:
        yield
    finally:
        dm.ttt_attention = saved


@torch.no_grad()
def ref_teacher(batch: Batch, draft: Eagle3Draft, target_head: torch.Tensor, chunk_tokens: int = 1024):
    b, t = batch.input_ids.shape
    n_draft = draft.config.draft_vocab_size
    head = target_head.detach().to(torch.float32)
    draft_ids = draft.draft_to_target
    states = batch.final_hidden.reshape(b * t, -1)
    probs = torch.empty(b * t, n_draft, dtype=torch.float32)
    in_draft = torch.empty(b * t, dtype=torch.bool)
    for start in range(0, b * t, chunk_tokens):
        logits = states[start:start + chunk_tokens].to(torch.float32) @ head.T
        in_draft[start:start + chunk_tokens] = draft.t2d[logits.argmax(dim=-1)]
        probs[start:start + chunk_tokens] = logits[:, draft_ids].softmax(dim=-1)
    return probs.view(b, t, n_draft), in_draft.view(b, t)


def ref_step_targets(batch, probs, in_draft, step):
    p = shift_left(probs, step + 1)
    trained = shift_left(batch.loss_mask, step + 2, False)
    return p, trained & shift_left(in_draft, step + 1, False)


def ref_ttt_loss(draft, batch, steps, decay, probs, in_draft):
    weights = tuple(decay ** i for i in range(steps))
    step_losses, sample_losses, counts = [], [], []
    chain_ok = torch.ones_like(batch.attention_mask, dtype=torch.bool)
    with reference_attention():
        for i, (_, logits) in enumerate(draft.steps(batch.aux_hidden, batch.input_ids, batch.attention_mask, steps)):
            p, valid = ref_step_targets(batch, probs, in_draft, i)
            logp = F.log_softmax(logits.float(), dim=-1)
            ce = torch.where(valid, -(p * logp).sum(-1), torch.zeros(()))
            sample_losses.append(ce.sum(1) / valid.sum(1).clamp_min(1))
            step_losses.append(ce.sum() / valid.sum().clamp_min(1))
            with torch.no_grad():
                right = (logits.argmax(-1) == p.argmax(-1)) & valid
                cond = chain_ok & valid
                counts.append(torch.stack([valid.sum(), right.sum(), cond.sum(), (cond & right).sum()]))
                chain_ok = cond & right
    step_loss = torch.stack(step_losses)
    return (step_loss * torch.tensor(weights)).sum(), step_loss, torch.stack(sample_losses, 1), torch.stack(counts, 1)


def ref_train_step(draft, optimizer, micro, *, ttt_steps, decay, target_head, lr, grad_clip, every_position=False):
    """every_position: every loss-masked position counts (loss_positions="all"), not only the in-draft ones."""
    params = [p for p in draft.parameters() if p.requires_grad]
    teachers = [ref_teacher(b, draft, target_head) for b in micro]
    if every_position:
        teachers = [(probs, b.attention_mask.clone()) for b, (probs, _) in zip(micro, teachers)]
    counts = torch.zeros(ttt_steps, dtype=torch.float64)
    for b, (probs, flags) in zip(micro, teachers):
        for i in range(ttt_steps):
            counts[i] += float(ref_step_targets(b, probs, flags, i)[1].sum())
    weights = torch.tensor([decay ** i for i in range(ttt_steps)], dtype=torch.float64)
    scale = (weights / counts.clamp_min(1)).float()
    optimizer.zero_grad(set_to_none=False)
    for b, (probs, flags) in zip(micro, teachers):
        _, step_loss, _, c = ref_ttt_loss(draft, b, ttt_steps, decay, probs, flags)
        ((step_loss * c[0].float()) * scale).sum().backward()
    torch.nn.utils.clip_grad_norm_(params, grad_clip)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()


# ---- realistic data: SmolLM2's states of real chats ---------------------------------------------------

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "The capital of France is Paris, a city known for the Eiffel Tower, the Louvre "
                                      "and its cafes along the Seine."}],
    [{"role": "user", "content": "Give me two tips for learning Python."},
     {"role": "assistant", "content": "1. Practice a little every day.\n2. Build small projects you care about."}],
    [{"role": "user", "content": "Write a function that reverses a string."},
     {"role": "assistant", "content": "def reverse(s: str) -> str:\n    return s[::-1]\n\nIt uses slicing with a "
                                      "step of -1, which walks the string backwards."}],
]


@pytest.fixture(scope="module")
def smol_setup():
    from tasks.extract.chat import render_and_mask
    from tasks.extract.hf_backend import ExtractSettings, HFExtractor, default_aux_layer_ids
    from tasks.model.target import load_target
    from tasks.extract.vocab import build_draft_vocab, count_tokens

    model, tokenizer = load_target(cache_dir=TARGET_CACHE)
    samples = [render_and_mask(tokenizer, c, 256) for c in CHATS]
    pairs = [(s.input_ids, s.loss_mask) for s in samples]
    aux = default_aux_layer_ids(model.config.num_hidden_layers)
    records = HFExtractor(model, ExtractSettings(aux_layer_ids=aux)).extract(pairs)
    vocab = build_draft_vocab(count_tokens(pairs, model.config.vocab_size), 512)
    config = DraftConfig.from_target_config(model.config, 512, aux)
    head = target_head_weight(model).clone()  # bf16, as the flow passes it
    embed = model.get_input_embeddings().weight.detach().clone()
    return records, config, vocab, head, embed


def _draft(setup, seed: int = 0) -> Eagle3Draft:
    _, config, vocab, _, embed = setup
    torch.manual_seed(seed)
    draft = Eagle3Draft(config)
    draft.set_vocab(vocab.d2t, vocab.t2d)
    load_target_embeddings(draft, embed)
    return draft


def _grads(draft: Eagle3Draft) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in draft.named_parameters() if p.requires_grad}


# ---- the tests -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fused", [True, False], ids=["fused", "portable"])
def test_attention_equals_the_dense_reference_forward_and_backward(fused, monkeypatch):
    if not fused:
        monkeypatch.setattr("tasks.model.attention.FUSED_ATTENTION_DEVICES", ())
    torch.manual_seed(0)
    b, nh, kvh, t, d = 3, 9, 3, 45, 64
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[0, 30:] = False
    mask[2, 7:] = False
    for steps in (1, 2, 7):
        q = torch.randn(b, nh, t, d, requires_grad=True)
        ks = [torch.randn(b, kvh, t, d, requires_grad=True) for _ in range(steps)]
        vs = [torch.randn(b, kvh, t, d, requires_grad=True) for _ in range(steps)]
        grad_out = torch.randn(b, nh, t, d)
        results = []
        for attend in (lambda: ttt_attention(q, ks, vs, mask),
                       lambda: ttt_attention(q, ks, vs, ttt_attention_mask(mask, 0)),  # the block given as such
                       lambda: ref_ttt_attention(q, ks, vs, ttt_attention_mask(mask, 0))):
            for x in [q, *ks, *vs]:
                x.grad = None
            out = attend()
            out.backward(grad_out)
            results.append([out.detach(), *(x.grad.clone() for x in [q, *ks, *vs])])
        for got, block, want in zip(*results):  # every query, padded ones included, follows the dense mask
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(block, want, rtol=1e-5, atol=1e-5)


def test_no_attention_sized_tensor_is_kept_for_backward():
    torch.manual_seed(0)
    b, nh, kvh, t, d = 1, 4, 2, 96, 16
    q = torch.randn(b, nh, t, d, requires_grad=True)
    ks = [torch.randn(b, kvh, t, d, requires_grad=True) for _ in range(4)]
    vs = [torch.randn(b, kvh, t, d, requires_grad=True) for _ in range(4)]
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: shapes.append(tuple(x.shape)) or x, lambda x: x):
        ttt_attention(q, ks, vs).sum().backward()
    assert shapes and not [s for s in shapes if len(s) >= 2 and s[-1] >= t and s[-2] >= t], shapes
    assert max(math.prod(s) for s in shapes) < t * t * nh  # O(T) per head, never T x T


def test_teacher_flags_are_bit_identical_and_probs_equal(smol_setup):
    records, _, _, head, _ = smol_setup
    draft = _draft(smol_setup)
    batch = collate(records)
    want_probs, want_flags = ref_teacher(batch, draft, head)
    got = teacher_targets(batch, draft, head)
    assert torch.equal(got.argmax_in_draft, want_flags)
    assert 0 < int(want_flags.sum()) < want_flags.numel()  # both kinds of position occur
    torch.testing.assert_close(got.probs, want_probs, rtol=0, atol=0)
    # small head blocks and position chunks: the same flags (the running maximum across blocks)
    small = teacher_targets(batch, draft, head, chunk_tokens=7, block_rows=1000)
    assert torch.equal(small.argmax_in_draft, want_flags)
    # trained_only: identical where a step can count a position
    trained = teacher_targets(batch, draft, head, trained_only=True)
    where = trained_teacher_positions(batch)
    assert torch.equal(trained.argmax_in_draft[where], want_flags[where])
    assert torch.equal(trained.probs[where], want_probs[where])


def test_teacher_flags_break_ties_like_argmax(smol_setup):
    """Exact ties between a draft and a non-draft token go to the lower target id, as argmax does."""
    _, _, _, head, _ = smol_setup
    draft = _draft(smol_setup)
    h = head.float()
    draft_ids = draft.draft_to_target
    others = (~draft.t2d).nonzero().squeeze(1)
    inner = draft_ids[(draft_ids > others.min()) & (draft_ids < others.max())]
    k = int(inner[len(inner) // 2])
    lo_other, hi_other = int(others[others < k][-1]), int(others[others > k][0])
    # Row sets where a non-draft token's head row equals draft token k's: its id lower, then higher.
    tied, tied2 = h.clone(), h.clone()
    for w, other in ((tied, lo_other), (tied2, hi_other)):
        w[k] = 4 * h[k]  # far above every other row's logit
        w[other] = w[k]
    t = 2
    final = torch.zeros(1, t, h.shape[1])
    final[0, :] = 40 * h[k] / h[k].norm()
    for w in (tied, tied2):
        batch = Batch(input_ids=torch.zeros(1, t, dtype=torch.int64), attention_mask=torch.ones(1, t, dtype=torch.bool),
                      loss_mask=torch.ones(1, t, dtype=torch.bool), aux_hidden=torch.zeros(1, t, 3 * h.shape[1]),
                      lengths=torch.tensor([t]), teacher="final_hidden", final_hidden=final.clone())
        _, want = ref_teacher(batch, draft, w)
        got = teacher_targets(batch, draft, w).argmax_in_draft
        assert torch.equal(got, want)
    assert not bool(teacher_targets(batch, draft, tied).argmax_in_draft[0, 0])  # lower non-draft id wins the tie
    assert bool(teacher_targets(batch, draft, tied2).argmax_in_draft[0, 0])  # the draft id is lower


@pytest.mark.parametrize("padded", [False, True], ids=["one-sample", "padded-batch"])
def test_loss_metrics_and_gradients_equal_the_reference(smol_setup, padded):
    records, _, _, head, _ = smol_setup
    batch = collate(records if padded else records[:1])
    steps = 7
    new, ref = _draft(smol_setup, 3), _draft(smol_setup, 3)
    r = ttt_loss(new, batch, steps=steps, target_head=head)
    r.loss.backward()
    probs, flags = ref_teacher(batch, ref, head)
    loss, step_loss, sample_loss, counts = ref_ttt_loss(ref, batch, steps, 0.8, probs, flags)
    loss.backward()
    assert int(counts[0].sum()) > 50
    assert torch.equal(torch.stack([r.valid, r.correct, r.conditional_valid, r.conditional_correct]), counts)
    torch.testing.assert_close(r.loss, loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(r.step_loss, step_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(r.sample_loss, sample_loss, rtol=1e-5, atol=1e-5)
    got, want = _grads(new), _grads(ref)
    assert got.keys() == want.keys()
    for name in got:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_weights_after_training_steps_equal_the_reference(smol_setup, monkeypatch):
    """Five optimizer steps of train_step, two micro-batches each (a padded one that runs sample by
    sample, and one whose teacher is kept from the counting pass), against the reference
    train_step: the same weights."""
    from tasks.train.steps import unpadded_pieces

    records, _, _, head, _ = smol_setup
    micro = [collate(records[:2]), collate(records[2:])]
    monkeypatch.setattr("tasks.train.steps.SPLIT_PADDING", 0.0)  # any padding: sample by sample
    assert len(unpadded_pieces(micro[0], micro[0].attention_mask)) == 2
    new, ref = _draft(smol_setup, 5), _draft(smol_setup, 5)
    opt_new, opt_ref = make_optimizer(new, 3e-3, 0.0), make_optimizer(ref, 3e-3, 0.0)
    losses = []
    for _ in range(5):
        m = train_step(new, opt_new, micro, None, ttt_steps=7, decay=0.8, target_head=head, lr=3e-3, grad_clip=0.5)
        ref_train_step(ref, opt_ref, micro, ttt_steps=7, decay=0.8, target_head=head, lr=3e-3, grad_clip=0.5)
        losses.append(m.loss)
    assert losses[-1] < losses[0]  # it trains
    got, want = new.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    # AdamW divides by sqrt(v): an element whose gradient is at rounding-noise level moves by a
    # noise-driven fraction of the lr, so the bound is a small fraction of the lr for every element
    # and 1e-6 for all but a handful (68 of 33.7M here, the frozen embeddings included).
    off, total = 0, 0
    for name in got:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0.01 * 3e-3, msg=lambda m: f"{name}: {m}")
        off += int(((got[name].float() - want[name].float()).abs() > 1e-6).sum())
        total += got[name].numel()
    assert off <= 1e-5 * total, (off, total)


def test_loss_positions_all_trains_as_the_reference_with_every_position_counted(smol_setup):
    """train_step with loss_positions="all" (speculators' loss): the weights after two steps are the reference's
    with every loss-masked position counted; the first step's metrics still count only the positions whose target
    argmax is a draft token, so they equal the default's on the same weights."""
    records, _, _, head, _ = smol_setup
    micro = [collate(records[:2]), collate(records[2:])]
    new, ref, default = _draft(smol_setup, 9), _draft(smol_setup, 9), _draft(smol_setup, 9)
    opt_new, opt_ref, opt_default = (make_optimizer(d, 3e-3, 0.0) for d in (new, ref, default))
    kw = dict(ttt_steps=3, decay=0.8, target_head=head, lr=3e-3, grad_clip=0.5)
    every = train_step(new, opt_new, micro, None, loss_positions="all", **kw)  # first step: metrics compared
    counted = train_step(default, opt_default, micro, None, **kw)
    train_step(new, opt_new, micro, None, loss_positions="all", **kw)
    for _ in range(2):
        ref_train_step(ref, opt_ref, micro, every_position=True, **kw)
    assert every.tokens == sum(int(shift_left(b.loss_mask, 2, False).sum()) for b in micro) > counted.tokens
    assert every.loss != counted.loss
    assert every.accuracy == pytest.approx(counted.accuracy, abs=1e-3)
    assert every.conditional_accuracy == pytest.approx(counted.conditional_accuracy, abs=1e-3)
    for name, x in new.state_dict().items():
        torch.testing.assert_close(x, ref.state_dict()[name], rtol=0, atol=0.01 * 3e-3, msg=lambda m: f"{name}: {m}")


def test_a_step_with_only_empty_slots_changes_nothing_but_takes_part(smol_setup):
    """A slot with no batch (None) adds nothing; a process with only empty slots still reduces zeros."""
    records, _, _, head, _ = smol_setup
    a, b = _draft(smol_setup, 7), _draft(smol_setup, 7)
    opt_a, opt_b = make_optimizer(a, 1e-3, 0.0), make_optimizer(b, 1e-3, 0.0)
    batch = collate(records[:1])
    ma = train_step(a, opt_a, [batch, None], None, ttt_steps=3, decay=0.8, target_head=head, lr=1e-3, grad_clip=0.5)
    mb = train_step(b, opt_b, [batch], None, ttt_steps=3, decay=0.8, target_head=head, lr=1e-3, grad_clip=0.5)
    assert ma.loss == mb.loss and ma.tokens == mb.tokens
    for (n, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), n
    seen = []
    empty = train_step(a, opt_a, [None], None, ttt_steps=3, decay=0.8, target_head=head, lr=1e-3, grad_clip=0.5,
                       all_reduce=lambda t: seen.append(t.shape))
    assert empty.tokens == 0 and len(seen) == 3  # counts, gradients, totals: the same calls as any process
