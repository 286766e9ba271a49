"""TTT metrics against what they must predict: conditional accuracy is the chance that speculation's
chain survives one more step, so the accepted tokens of a replayed greedy verification equal the sum
of the conditional correct counts. Checked with drafts whose answers are known (a copy of the
teacher, and one wrong at random places), which no misaligned chain condition passes by chance."""

from __future__ import annotations

import pytest
import torch

from tasks.model.draft import DraftConfig, Eagle3Draft
from tasks.train.ttt import Batch, collate, teacher_targets, ttt_loss
from tasks.extract.hf_backend import Extracted

V = H = 64  # hidden size = vocab, so a step's hidden state can spell out its answer
STEPS, T = 4, 200


def _draft() -> Eagle3Draft:
    config = DraftConfig(hidden_size=H, num_attention_heads=2, num_key_value_heads=1, head_dim=H // 2,
                         intermediate_size=64, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                         max_position_embeddings=1024, hidden_act="silu", target_vocab_size=V, draft_vocab_size=V,
                         aux_layer_ids=[0, 1, 2], target_num_layers=4)
    draft = Eagle3Draft(config)
    draft.set_vocab(torch.zeros(V, dtype=torch.int64), torch.ones(V, dtype=torch.bool))
    with torch.no_grad():  # logits = the normed hidden state: its largest entry is the draft's answer
        draft.lm_head.weight.copy_(torch.eye(V))
    return draft


def _batch(seed: int) -> tuple[Batch, list[int]]:
    """One sample whose teacher is one-hot on the data's next token (greedy target output), loss on 80%."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (T,), generator=g)
    loss = (torch.rand(T, generator=g) < 0.8).to(torch.uint8)
    rec = Extracted(index=0, input_ids=ids.to(torch.int32), loss_mask=loss, aux_hidden=torch.zeros(T, 3 * H),
                    topk_ids=torch.cat([ids[1:], ids[:1]]).to(torch.int32)[:, None],
                    topk_logprobs=torch.zeros(T, 1, dtype=torch.float16), argmax_in_draft=torch.ones(T, dtype=torch.bool))
    return collate([rec]), ids.tolist()


def _scripted(draft: Eagle3Draft, ids: list[int], right: torch.Tensor) -> None:
    """Make step i's hidden state at t spell token t+i+2 where right[t, i], another token elsewhere."""
    def hidden_steps(aux_hidden, input_ids, attention_mask=None, steps=STEPS):
        for i in range(steps):
            hidden = torch.zeros(1, T, H)
            for t in range(T):
                truth = ids[t + i + 2] if t + i + 2 < T else 0
                hidden[0, t, truth if right[t, i] else (truth + 1) % V] = 10.0
            yield hidden

    def steps(aux_hidden, input_ids, attention_mask=None, steps=STEPS):
        for hidden in hidden_steps(aux_hidden, input_ids, attention_mask, steps):
            yield hidden, draft.lm_head(draft.norm(hidden))

    draft.hidden_steps = hidden_steps  # type: ignore[attr-defined]
    draft.steps = steps  # type: ignore[method-assign]


def _replay(ids: list[int], loss_mask: list[int], right: torch.Tensor) -> tuple[list[int], list[int]]:
    """Per step i: positions that reach step i in greedy verification, and those accepted there.

    At position t the draft proposes tokens t+2, t+3, ... in turn; step i is tried only where steps
    before it were trained and accepted, and counted only where token t+i+2 is trained. A plain loop
    over positions: the definition, with none of ttt_loss's shifted masks.
    """
    reached, accepted = [0] * STEPS, [0] * STEPS
    for t in range(T):
        for i in range(STEPS):
            if t + i + 2 >= T or not loss_mask[t + i + 2]:
                break
            reached[i] += 1
            if not right[t, i]:
                break
            accepted[i] += 1
    return reached, accepted


@pytest.mark.parametrize("seed", [0, 1])
def test_a_draft_that_copies_the_teacher_has_conditional_accuracy_one_at_every_step(seed):
    draft = _draft()
    batch, ids = _batch(seed)
    _scripted(draft, ids, torch.ones(T, STEPS, dtype=torch.bool))
    r = ttt_loss(draft, batch, steps=STEPS, teacher=teacher_targets(batch, draft))
    assert (r.valid > 100).all()  # enough positions that 1.0 is not luck
    assert r.accuracy.tolist() == [1.0] * STEPS
    assert r.conditional_accuracy.tolist() == [1.0] * STEPS
    # a trained position's chain only breaks where the data is not trained
    reached, accepted = _replay(ids, batch.loss_mask[0].tolist(), torch.ones(T, STEPS, dtype=torch.bool))
    assert r.conditional_valid.tolist() == reached and r.conditional_correct.tolist() == accepted


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_conditional_counts_equal_a_replayed_greedy_verification(seed):
    """Wrong at random (t, i): the counts must be those of the chains a verifier accepts, step by step."""
    draft = _draft()
    batch, ids = _batch(seed)
    g = torch.Generator().manual_seed(100 + seed)
    right = torch.rand(T, STEPS, generator=g) < torch.tensor([0.8, 0.6, 0.7, 0.5])
    _scripted(draft, ids, right)
    r = ttt_loss(draft, batch, steps=STEPS, teacher=teacher_targets(batch, draft))
    reached, accepted = _replay(ids, batch.loss_mask[0].tolist(), right)
    assert r.conditional_valid.tolist() == reached
    assert r.conditional_correct.tolist() == accepted
    # plain accuracy ignores the chain, so it differs from the conditional one once a step fails
    assert r.accuracy[1:].tolist() != r.conditional_accuracy[1:].tolist()
    # and mean tokens accepted per verified position = sum of accepted counts / positions reached at step 0
    assert abs(sum(accepted) / reached[0] - float(r.conditional_correct.sum()) / float(r.conditional_valid[0])) < 1e-12
