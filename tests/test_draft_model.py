"""EAGLE-3 draft model: config from real target configs, the TTT attention mask and token/teacher
alignment, padding invariance, masking, teachers, training on tiny data, bf16 autocast, and an
overfit on real SmolLM2 hidden states of real chat samples."""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tasks.model.attention import ttt_attention, ttt_attention_mask
from tasks.model.draft import (DraftConfig, Eagle3Draft, init_head_from_target, load_target_embeddings,
                               target_final_norm_weight, target_head_weight)
from tasks.train.ttt import Batch, collate, step_targets, step_valid_mask, teacher_targets, ttt_loss
from tasks.extract.hf_backend import Extracted, ExtractSettings, HFExtractor, default_aux_layer_ids

TARGET_CACHE = Path(tempfile.gettempdir()) / "eagle3-test-targets"  # shared with the other test modules
V, H, N_DRAFT, LAYERS, AUX = 512, 64, 128, 6, (1, 2, 4)


def _tiny_target():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=V)
    return LlamaForCausalLM(config).eval()


def _vocab(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:N_DRAFT].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(N_DRAFT), t2d


def _draft(target, seed: int = 1) -> Eagle3Draft:
    torch.manual_seed(seed)
    draft = Eagle3Draft(DraftConfig.from_target_config(target.config, N_DRAFT, AUX))
    draft.set_vocab(*_vocab())
    load_target_embeddings(draft, target)
    return draft


def _samples(n: int, lo: int, hi: int, seed: int) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        t = int(torch.randint(lo, hi + 1, (1,), generator=g))
        out.append((torch.randint(0, V, (t,), generator=g).tolist(), [0] * (t // 3) + [1] * (t - t // 3)))
    return out


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny():
    return _tiny_target()


@pytest.fixture(scope="module")
def records(tiny) -> list[Extracted]:
    return HFExtractor(tiny, ExtractSettings(aux_layer_ids=list(AUX))).extract(_samples(4, 10, 24, seed=3))


@pytest.fixture(scope="module")
def smol():
    from tasks.model.target import load_target

    return load_target(cache_dir=TARGET_CACHE)


# ---- configuration ---------------------------------------------------------------------------------

def test_config_from_llama_smollm2_and_kimi_shaped_targets(smol):
    model, _ = smol
    c = DraftConfig.from_target_config(model.config, 32000, default_aux_layer_ids(30))
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (576, 9, 3, 64)
    assert (c.target_vocab_size, c.target_num_layers, c.aux_layer_ids) == (49152, 30, (1, 14, 26))
    assert c.rope_theta == 100000.0 and c.rope_scaling is None and c.intermediate_size == 1536
    d = Eagle3Draft(c)
    assert d.midlayer.self_attn.q_proj.weight.shape == (9 * 64, 2 * 576)  # q/k/v read [embeds, hidden]
    assert d.midlayer.self_attn.k_proj.weight.shape == (3 * 64, 2 * 576)
    assert d.fc.weight.shape == (576, 3 * 576) and d.lm_head.weight.shape == (32000, 576)
    assert d.embed_tokens.weight.shape == (49152, 576) and not d.embed_tokens.weight.requires_grad

    from transformers import DeepseekV3Config

    # Kimi-K2.5's text config is DeepSeek-V3 shaped (MLA, yarn). Its head_dim (64) is the rope part
    # of MLA heads; a plain Llama draft layer uses hidden / heads.
    yarn = {"type": "yarn", "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096}
    kimi = DeepseekV3Config(hidden_size=7168, num_attention_heads=64, num_key_value_heads=None, rope_scaling=yarn,
                            rope_theta=50000.0, max_position_embeddings=262144, vocab_size=163840, num_hidden_layers=61)
    k = DraftConfig.from_target_config(kimi, 32000, default_aux_layer_ids(61))
    assert (k.num_attention_heads, k.num_key_value_heads, k.head_dim) == (64, 64, 112)
    assert k.aux_layer_ids == (1, 29, 57) and k.rope_theta == 50000.0
    assert k.rope_scaling["rope_type"] == "yarn" and k.rope_scaling["factor"] == 32.0 and "type" not in k.rope_scaling
    as_dict = {"hidden_size": 7168, "num_attention_heads": 64, "num_hidden_layers": 61, "vocab_size": 163840,
               "intermediate_size": 18432, "kv_lora_rank": 512, "head_dim": 64, "rope_theta": 50000.0,
               "rope_scaling": yarn}
    assert DraftConfig.from_target_config(as_dict, 32000, [1, 29, 57]) == k.__class__(
        **{**k.to_dict(), "max_position_embeddings": 4096, "rms_norm_eps": 1e-6})
    assert DraftConfig.from_dict(k.to_dict()) == k
    # A smaller draft layer than the target's, as the published Kimi drafts use.
    assert DraftConfig.from_target_config(kimi, 32000, [1, 29, 57], intermediate_size=12288).intermediate_size == 12288


@pytest.mark.parametrize("change, field", [
    ({"draft_vocab_size": V + 1}, "draft_vocab_size"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"aux_layer_ids": (1, 2, 5)}, "aux_layer_ids"),
    ({"aux_layer_ids": (1, 2)}, "aux_layer_ids"),
    ({"head_dim": 15}, "head_dim"),
    ({"hidden_act": "nope"}, "hidden_act"),
    ({"rope_scaling": {"rope_type": "no-such-rope"}}, "rope_scaling"),
    ({"hidden_size": 0}, "hidden_size"),
])
def test_config_errors_name_the_field(tiny, change, field):
    base = DraftConfig.from_target_config(tiny.config, N_DRAFT, AUX).to_dict()
    with pytest.raises(ValueError, match=field):
        DraftConfig(**{**base, **change})
    with pytest.raises(ValueError, match="unknown DraftConfig fields"):
        DraftConfig.from_target_config(tiny.config, N_DRAFT, AUX, hidden=3)


def test_vocab_is_checked_and_embeddings_frozen(tiny):
    draft = _draft(tiny)
    d2t, t2d = _vocab()
    assert torch.equal(draft.draft_to_target, d2t + torch.arange(N_DRAFT))
    assert torch.equal(draft.target_to_draft()[draft.draft_to_target], torch.arange(N_DRAFT))
    with pytest.raises(ValueError, match="absolute"):
        draft.set_vocab(d2t + torch.arange(N_DRAFT), t2d)  # target ids where offsets belong
    assert torch.equal(draft.embed_tokens.weight, tiny.get_input_embeddings().weight)
    assert not draft.embed_tokens.weight.requires_grad
    trainable = {n for n, p in draft.named_parameters() if p.requires_grad}
    assert "embed_tokens.weight" not in trainable and "midlayer.hidden_norm.weight" in trainable
    with pytest.raises(ValueError, match="shape"):
        load_target_embeddings(draft, torch.zeros(V + 1, H))


# ---- attention and alignment -----------------------------------------------------------------------

def test_a_head_started_from_the_target_gives_the_targets_logits_over_the_draft_vocab(tiny):
    target = copy.deepcopy(tiny)
    with torch.no_grad():
        target.model.norm.weight.uniform_(0.5, 1.5)  # a final norm that is not all ones, so copying it shows
    draft = _draft(target)
    head, norm = target_head_weight(target), target_final_norm_weight(target)
    hidden = torch.randn(2, 5, H)
    with torch.no_grad():
        want = target.lm_head(target.model.norm(hidden))[..., draft.draft_to_target]
        assert not torch.allclose(draft.lm_head(draft.norm(hidden)), want, atol=1e-2)  # a random head: unrelated
        init_head_from_target(draft, head, norm)
        torch.testing.assert_close(draft.lm_head(draft.norm(hidden)), want, rtol=1e-5, atol=1e-5)
    assert draft.lm_head.weight.requires_grad and draft.norm.weight.requires_grad  # a start, not frozen
    with pytest.raises(ValueError, match="set_vocab"):
        init_head_from_target(Eagle3Draft(draft.config), head, norm)
    with pytest.raises(ValueError, match="target head has shape"):
        init_head_from_target(draft, head[:-1], norm)
    with pytest.raises(ValueError, match="final norm has shape"):
        init_head_from_target(draft, head, norm[:-1])


def test_ttt_attention_mask_and_attention_follow_it():
    mask = ttt_attention_mask(torch.tensor([[1, 1, 1, 0]], dtype=torch.bool), step=2)
    # Query t=2: step-0 keys 0..2, and in each later step only its own position.
    assert mask[0, 2].int().tolist() == [1, 1, 1, 0] + [0, 0, 1, 0] + [0, 0, 1, 0]
    # Query t=3 (padding) never sees the padded step-0 key 3.
    assert mask[0, 3, :4].int().tolist() == [1, 1, 1, 0]
    assert mask[0, 0].int().tolist() == [1, 0, 0, 0] * 3

    # The efficient attention equals plain attention over all cached keys under the dense mask.
    torch.manual_seed(0)
    b, nh, kvh, t, d, steps = 2, 4, 2, 7, 8, 3
    attention_mask = torch.tensor([[1] * 5 + [0] * 2, [1] * 7], dtype=torch.bool)
    q = torch.randn(b, nh, t, d)
    keys = [torch.randn(b, kvh, t, d) for _ in range(steps)]
    values = [torch.randn(b, kvh, t, d) for _ in range(steps)]
    got = ttt_attention(q, keys, values, attention_mask)
    dense = ttt_attention_mask(attention_mask, steps - 1)[:, None]  # [B, 1, T, T*steps]
    k_all = torch.cat(keys, dim=2).repeat_interleave(nh // kvh, dim=1)
    v_all = torch.cat(values, dim=2).repeat_interleave(nh // kvh, dim=1)
    want = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=dense)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_step_i_at_position_t_reads_tokens_up_to_t_plus_i_plus_1_and_no_later_state(tiny):
    draft = _draft(tiny)
    torch.manual_seed(5)
    t_len, steps, t0 = 16, 3, 6
    aux = torch.randn(1, t_len, 3 * H)
    ids = torch.randint(0, V, (1, t_len))
    with torch.no_grad():
        base = draft(aux, ids, steps=steps)
        for i in range(steps):
            # The token step i reads at t0 moves step i's logits there, and no earlier step's.
            changed = ids.clone()
            changed[0, t0 + i + 1] = (ids[0, t0 + i + 1] + 1) % V
            out = draft(aux, changed, steps=steps)
            for j in range(steps):
                moved = not torch.equal(out[j][0, t0], base[j][0, t0])
                assert moved == (j >= i), (i, j)
        # Nothing after position t0 (aux) or after the tokens read reaches positions <= t0.
        later_aux, later_ids = aux.clone(), ids.clone()
        later_aux[0, t0 + 1:] = torch.randn(t_len - t0 - 1, 3 * H)
        later_ids[0, t0 + steps + 1:] = torch.randint(0, V, (t_len - t0 - steps - 1,))
        out = draft(later_aux, later_ids, steps=steps)
        for j in range(steps):
            torch.testing.assert_close(out[j][0, :t0 + 1], base[j][0, :t0 + 1], rtol=0, atol=0)
            assert not torch.equal(out[j][0, t0 + 1:], base[j][0, t0 + 1:])


def _topk_batch(ids: list[int], loss_mask: list[int], teacher_ids: list[int], aux_width: int = 3 * H) -> Batch:
    t = len(ids)
    rec = Extracted(index=0, input_ids=torch.tensor(ids, dtype=torch.int32),
                    loss_mask=torch.tensor(loss_mask, dtype=torch.uint8),
                    aux_hidden=torch.randn(t, aux_width).bfloat16(),
                    topk_ids=torch.tensor(teacher_ids, dtype=torch.int32)[:, None],
                    topk_logprobs=torch.zeros(t, 1, dtype=torch.float16),
                    argmax_in_draft=torch.ones(t, dtype=torch.bool))
    return collate([rec])


def test_step_targets_are_the_teacher_of_token_t_plus_i_plus_2(tiny):
    draft = _draft(tiny)
    in_draft = draft.draft_to_target.tolist()
    ids = in_draft[:14]
    # A perfect next-token teacher: the distribution at u is one-hot on token u+1.
    b = _topk_batch(ids, [1] * 14, ids[1:] + ids[:1])
    teacher = teacher_targets(b, draft)
    to_draft = draft.target_to_draft()
    for i in range(3):
        probs, valid = (x[0] for x in step_targets(b, teacher, i))
        ts = valid.nonzero().squeeze(1)
        assert ts.tolist() == list(range(14 - i - 2))  # token t+i+2 must exist in the sample
        assert torch.equal(probs[ts].argmax(-1), to_draft[torch.tensor(ids)[ts + i + 2]])
    # loss_mask is per token: a single trained token m is predicted at step i from position m-i-2.
    m = 9
    b = _topk_batch(ids, [0] * m + [1] + [0] * (13 - m), ids[1:] + ids[:1])
    teacher = teacher_targets(b, draft)
    for i in range(4):
        assert step_targets(b, teacher, i)[1][0].nonzero().squeeze(1).tolist() == [m - i - 2]
    r = ttt_loss(draft, b, steps=4, teacher=teacher)
    assert r.valid.tolist() == [1, 1, 1, 1]


def test_padding_invariance(tiny, records):
    draft = _draft(tiny)
    head = target_head_weight(tiny)
    short = min(records, key=lambda r: r.input_ids.shape[0])
    long = max(records, key=lambda r: r.input_ids.shape[0])
    assert long.input_ids.shape[0] > short.input_ids.shape[0]
    alone, mixed = collate([short]), collate([short, long])
    n = short.input_ids.shape[0]
    with torch.no_grad():
        a = draft(alone.aux_hidden, alone.input_ids, alone.attention_mask, steps=4)
        m = draft(mixed.aux_hidden, mixed.input_ids, mixed.attention_mask, steps=4)
        for x, y in zip(a, m):
            torch.testing.assert_close(x[0, :n], y[0, :n], rtol=1e-5, atol=1e-5)
        ra = ttt_loss(draft, alone, steps=4, target_head=head)
        rm = ttt_loss(draft, mixed, steps=4, target_head=head)
    torch.testing.assert_close(ra.sample_loss[0], rm.sample_loss[0], rtol=1e-5, atol=1e-6)
    assert torch.all(rm.valid >= ra.valid) and torch.all(ra.valid > 0)


def _sure_of_a_non_draft_token(tiny, seed: int):
    """(draft, target head, record, u): 14 tokens whose target is sure, at u, of a token outside the draft vocab."""
    draft = _draft(tiny)
    head = target_head_weight(tiny).float()
    outside = int((~draft.t2d).nonzero()[0])
    torch.manual_seed(seed)
    t, u = 14, 6
    final = 0.01 * torch.randn(t, H)
    final[u] = 50 * head[outside] / head[outside].norm()
    rec = Extracted(index=0, input_ids=torch.randint(0, V, (t,), dtype=torch.int32),
                    loss_mask=torch.ones(t, dtype=torch.uint8), aux_hidden=torch.randn(t, 3 * H).bfloat16(),
                    final_hidden=final.bfloat16())
    return draft, head, rec, u


def _another_non_draft_target_at(draft, head, rec, u):
    """The same record, its target at u another distribution whose argmax is still outside the draft vocab:
    (batch, teacher)."""
    outside = int((~draft.t2d).nonzero()[0])
    final = rec.final_hidden.float().clone()
    final[u] = 80 * head[outside] / head[outside].norm() + 0.5 * torch.randn(final.shape[1])
    b = collate([Extracted(**{**rec.__dict__, "final_hidden": final.bfloat16()})])
    teacher = teacher_targets(b, draft, head)
    assert not teacher.argmax_in_draft[0, u]
    return b, teacher


def test_positions_whose_target_argmax_is_outside_the_draft_vocab_are_masked(tiny):
    draft, head, rec, u = _sure_of_a_non_draft_token(tiny, 2)
    t = rec.input_ids.shape[0]
    b = collate([rec])
    teacher = teacher_targets(b, draft, head)
    assert not teacher.argmax_in_draft[0, u] and teacher.argmax_in_draft[0, u - 1:u + 2].sum() < 3
    for i in range(3):
        assert not step_targets(b, teacher, i)[1][0, u - i - 1]  # the position whose teacher is u
    r = ttt_loss(draft, b, steps=3, teacher=teacher)
    # Whatever the target says at u, the loss is the same: that teacher is never used.
    b2, t2 = _another_non_draft_target_at(draft, head, rec, u)
    torch.testing.assert_close(ttt_loss(draft, b2, steps=3, teacher=t2).loss, r.loss, rtol=0, atol=0)
    expected = [int(step_valid_mask(b, teacher, i).sum()) for i in range(3)]
    assert r.valid.tolist() == expected and all(e < t - 2 - i for i, e in enumerate(expected))


def test_speculators_loss_positions_train_where_the_target_argmax_is_outside_the_draft_vocab(tiny):
    """loss_positions="all": every loss-masked position trains, the non-draft argmax ones included, toward the
    target's distribution over the draft vocab; the metrics still count only the positions a draft can win."""
    draft, head, rec, u = _sure_of_a_non_draft_token(tiny, 3)
    t = rec.input_ids.shape[0]
    b = collate([rec])
    teacher = teacher_targets(b, draft, head)
    assert not teacher.argmax_in_draft[0, u]
    counted = ttt_loss(draft, b, steps=3, teacher=teacher)
    every = ttt_loss(draft, b, steps=3, teacher=teacher, loss_positions="all")
    assert every.trained.tolist() == [t - 2 - i for i in range(3)]  # token t+i+2 exists: every position
    assert counted.trained.tolist() == counted.valid.tolist()
    assert all(e > c for e, c in zip(every.trained.tolist(), counted.trained.tolist()))
    for name in ("valid", "correct", "conditional_valid", "conditional_correct"):
        assert getattr(every, name).tolist() == getattr(counted, name).tolist(), name
    # The teacher at u now reaches the loss: another target distribution there, another loss.
    b2, t2 = _another_non_draft_target_at(draft, head, rec, u)
    assert not torch.equal(ttt_loss(draft, b2, steps=3, teacher=t2, loss_positions="all").loss, every.loss)
    with pytest.raises(ValueError, match="loss_positions"):
        ttt_loss(draft, b, steps=3, teacher=teacher, loss_positions="everywhere")  # type: ignore[arg-type]


def test_topk_and_final_hidden_teachers_agree_when_k_is_the_draft_vocab(tiny):
    _, t2d = _vocab()
    samples = _samples(3, 12, 20, seed=7)
    fh = HFExtractor(tiny, ExtractSettings(aux_layer_ids=list(AUX))).extract(samples)
    topk = ExtractSettings(aux_layer_ids=list(AUX), teacher="topk", topk=N_DRAFT)
    tk = HFExtractor(tiny, topk, t2d=t2d).extract(samples)
    draft = _draft(tiny)
    bf, bt = collate(fh), collate(tk)
    tf, tt = teacher_targets(bf, draft, target_head_weight(tiny)), teacher_targets(bt, draft)
    assert torch.equal(tf.argmax_in_draft & bf.attention_mask, tt.argmax_in_draft)
    torch.testing.assert_close(tt.probs[bt.attention_mask], tf.probs[bf.attention_mask], rtol=0, atol=2e-3)
    with torch.no_grad():
        rf, rt = ttt_loss(draft, bf, steps=3, teacher=tf), ttt_loss(draft, bt, steps=3, teacher=tt)
    assert rf.valid.tolist() == rt.valid.tolist()
    torch.testing.assert_close(rt.step_loss, rf.step_loss, rtol=2e-3, atol=0)
    # A top-k id outside this draft's vocab means the records were made for another vocab.
    bad = collate(tk)
    bad.topk_ids[0, 0, 0] = int((~draft.t2d).nonzero()[0])
    with pytest.raises(ValueError, match="outside this draft's vocab"):
        teacher_targets(bad, draft)


def test_collate_right_pads_dequantises_fp8_and_refuses_mixed_teachers(tiny, records):
    from tasks.extract.hf_backend import aux_hidden_float

    samples = _samples(2, 8, 15, seed=11)
    fp8 = HFExtractor(tiny, ExtractSettings(aux_layer_ids=list(AUX), storage="fp8")).extract(samples)
    b = collate(fp8, pad_token_id=7)
    lengths = [len(s[0]) for s in samples]
    assert b.lengths.tolist() == lengths and b.input_ids.shape == (2, max(lengths))
    for i, n in enumerate(lengths):
        assert torch.equal(b.aux_hidden[i, :n], aux_hidden_float(fp8[i]))
        assert b.attention_mask[i].tolist() == [True] * n + [False] * (max(lengths) - n)
        assert torch.all(b.input_ids[i, n:] == 7) and not b.loss_mask[i, n:].any()
        assert b.loss_mask[i, :n].tolist() == [bool(x) for x in samples[i][1]]
    _, t2d = _vocab()
    topk = HFExtractor(tiny, ExtractSettings(aux_layer_ids=list(AUX), teacher="topk", topk=4), t2d=t2d).extract(samples)
    with pytest.raises(ValueError, match="mix"):
        collate([records[0], topk[0]])
    with pytest.raises(ValueError, match="at least one"):
        collate([])


# ---- training ----------------------------------------------------------------------------------------

def test_loss_decreases_and_accuracy_rises_on_tiny_data(tiny):
    draft = _draft(tiny)
    in_draft = draft.draft_to_target
    g = torch.Generator().manual_seed(4)
    recs = []
    for n in (14, 18, 22, 16):  # a peaked teacher (the next token itself), so there is something to learn
        ids = in_draft[torch.randint(0, N_DRAFT, (n,), generator=g)].tolist()
        b = _topk_batch(ids, [0] * 3 + [1] * (n - 3), ids[1:] + ids[:1])
        recs.append(Extracted(index=len(recs), input_ids=b.input_ids[0].int(), loss_mask=b.loss_mask[0].to(torch.uint8),
                              aux_hidden=b.aux_hidden[0].bfloat16(), topk_ids=b.topk_ids[0].int(),
                              topk_logprobs=b.topk_logprobs[0].half(), argmax_in_draft=b.argmax_in_draft[0]))
    batch = collate(recs)
    teacher = teacher_targets(batch, draft)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    first = ttt_loss(draft, batch, steps=3, teacher=teacher)
    for _ in range(30):
        r = ttt_loss(draft, batch, steps=3, teacher=teacher)
        opt.zero_grad()
        r.loss.backward()
        opt.step()
    last = ttt_loss(draft, batch, steps=3, teacher=teacher)
    assert torch.all(last.step_loss < first.step_loss / 2), (first.step_loss, last.step_loss)
    assert last.accuracy[0] > first.accuracy[0] + 0.5, (first.accuracy, last.accuracy)
    assert torch.all(last.conditional_valid <= last.valid) and torch.all(last.conditional_correct <= last.correct)
    assert last.conditional_valid[0] == last.valid[0] and last.conditional_valid[1] <= last.correct[0]
    assert last.weights == pytest.approx((1.0, 0.8, 0.64))
    torch.testing.assert_close(last.loss, (last.step_loss * torch.tensor([1.0, 0.8, 0.64])).sum())


def test_bf16_autocast_on_cpu_matches_fp32(tiny, records):
    draft = _draft(tiny)
    batch = collate(records)
    teacher = teacher_targets(batch, draft, target_head_weight(tiny))
    ref = ttt_loss(draft, batch, steps=3, teacher=teacher)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        r = ttt_loss(draft, batch, steps=3, teacher=teacher)
    r.loss.backward()
    torch.testing.assert_close(r.step_loss.detach(), ref.step_loss.detach(), rtol=3e-2, atol=0)
    grads = [p.grad for p in draft.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    # Casting the whole draft to bf16 keeps the rope frequencies in float32.
    half = copy.deepcopy(draft).to(torch.bfloat16)
    assert half.rope_inv_freq.dtype == torch.float32
    with torch.no_grad():
        r16 = ttt_loss(half, batch, steps=3, teacher=teacher)
    torch.testing.assert_close(r16.step_loss, ref.step_loss.detach(), rtol=5e-2, atol=0)


def test_smollm2_step0_accuracy_after_short_overfit_on_real_chat_hidden_states(smol):
    from tasks.extract.chat import Sample, render_and_mask
    from tasks.extract.vocab import build_draft_vocab, count_tokens

    model, tokenizer = smol
    chats = [
        [{"role": "user", "content": "What is the capital of France?"},
         {"role": "assistant", "content": "The capital of France is Paris, a city known for the Eiffel Tower."}],
        [{"role": "user", "content": "Give me two tips for learning Python."},
         {"role": "assistant", "content": "1. Practice a little every day.\n2. Build small projects you care about."}],
        [{"role": "user", "content": "What is a prime number?"},
         {"role": "assistant", "content": "A prime number is a whole number greater than 1 whose only divisors are 1 "
                                          "and itself, such as 2, 3, 5 and 7."}],
    ]
    samples = [render_and_mask(tokenizer, c, 256) for c in chats]
    assert all(isinstance(s, Sample) for s in samples)
    pairs = [(s.input_ids, s.loss_mask) for s in samples]
    aux = default_aux_layer_ids(model.config.num_hidden_layers)
    records = HFExtractor(model, ExtractSettings(aux_layer_ids=aux)).extract(pairs)
    vocab = build_draft_vocab(count_tokens(pairs, model.config.vocab_size), 1024)
    torch.manual_seed(0)
    draft = Eagle3Draft(DraftConfig.from_target_config(model.config, 1024, aux))
    draft.set_vocab(vocab.d2t, vocab.t2d)
    load_target_embeddings(draft, model)
    batch = collate(records)
    teacher = teacher_targets(batch, draft, target_head_weight(model))
    assert teacher.argmax_in_draft[batch.loss_mask].float().mean() > 0.8  # the vocab covers what the target says
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=2e-3)
    start = ttt_loss(draft, batch, steps=2, teacher=teacher)
    for _ in range(25):
        r = ttt_loss(draft, batch, steps=2, teacher=teacher)
        opt.zero_grad()
        r.loss.backward()
        opt.step()
    end = ttt_loss(draft, batch, steps=2, teacher=teacher)
    assert end.valid[0] >= 40
    assert start.accuracy[0] < 0.1  # chance is 1/1024
    assert end.accuracy[0] > 0.6, end.accuracy
    assert end.step_loss[0] < start.step_loss[0] / 2
