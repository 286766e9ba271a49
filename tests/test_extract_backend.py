"""Extraction backend: aux-layer convention, teachers, fp8, padding invariance and NaN quarantine,
on a tiny random Llama (fp32, exact checks) and on SmolLM2 (bf16, realistic magnitudes)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from tasks.extract.hf_backend import (Extracted, ExtractSettings, HFExtractor, Quarantined, default_aux_layer_ids,
                           dequantize_fp8, quantize_fp8, validate_aux_layer_ids)

TARGET_CACHE = Path(tempfile.gettempdir()) / "eagle3-test-targets"  # shared with tests/test_launch.py


def _tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=512)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def tiny():
    return _tiny()


@pytest.fixture(scope="module")
def smol():
    from tasks.model.target import load_target

    model, _ = load_target(cache_dir=TARGET_CACHE)
    return model


def _samples(n: int, vocab: int, lo: int, hi: int, seed: int) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        t = int(torch.randint(lo, hi + 1, (1,), generator=g))
        ids = torch.randint(0, vocab, (t,), generator=g).tolist()
        out.append((ids, [0] * (t // 3) + [1] * (t - t // 3)))
    return out


def _direct(model, ids: list[int]):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids]), output_hidden_states=True)


def _t2d(vocab: int, seed: int) -> torch.Tensor:
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[: vocab // 4]] = True
    return t2d


# ---- layer ids ---------------------------------------------------------------------------------

def test_default_and_invalid_aux_layer_ids():
    assert default_aux_layer_ids(30) == [1, 14, 26]
    assert default_aux_layer_ids(61) == [1, 29, 57]
    assert validate_aux_layer_ids([0, 2, 4], 6) == [0, 2, 4]
    for bad, match in [([1, 2, 6], "out of range"), ([-1, 2, 3], "out of range"), ([3, 1, 2], "ascending"),
                       ([1, 1, 2], "distinct"), ([1, 2], "exactly 3"), ([1, 2, 5], "last layer")]:
        with pytest.raises(ValueError, match=match):
            validate_aux_layer_ids(bad, 6)
    with pytest.raises(ValueError, match="out of range"):
        HFExtractor(_tiny(), ExtractSettings(aux_layer_ids=[0, 3, 9]))
    with pytest.raises(ValueError, match="t2d"):
        HFExtractor(_tiny(), ExtractSettings(aux_layer_ids=[0, 2, 4], teacher="topk"))


# ---- tiny Llama: exact checks --------------------------------------------------------------------

def test_aux_and_final_hidden_match_direct_forward(tiny):
    ids_ = [0, 2, 4]
    samples = _samples(5, 512, 3, 40, seed=1)
    # one by one: exact; batching changes fp32 kernel rounding (~1e-7), tested separately
    bf16 = HFExtractor(tiny, ExtractSettings(aux_layer_ids=ids_), max_batch_tokens=1).extract(samples)
    for i, (ids, mask) in enumerate(samples):
        r = bf16[i]
        assert isinstance(r, Extracted) and r.index == i
        assert r.input_ids.dtype == torch.int32 and r.input_ids.tolist() == ids
        assert r.loss_mask.dtype == torch.uint8 and r.loss_mask.tolist() == mask
        assert r.aux_hidden.dtype == torch.bfloat16 and r.aux_hidden.shape == (len(ids), 3 * 64)
        assert r.aux_scale is None and r.topk_ids is None
        out = _direct(tiny, ids)
        hs = out.hidden_states
        want = torch.cat([hs[j + 1][0] for j in ids_], dim=-1)
        # bf16 storage of fp32 states: exactly the rounding of the right layers (a wrong layer is far off)
        assert torch.equal(r.aux_hidden, want.to(torch.bfloat16))
        assert not torch.equal(r.aux_hidden, torch.cat([hs[j][0] for j in ids_], dim=-1).to(torch.bfloat16))
        assert torch.equal(r.final_hidden, hs[-1][0].to(torch.bfloat16))
        # usable by a trainer: no inference tensors (autograd refuses them), no views of the batch
        assert not r.aux_hidden.is_inference() and not r.final_hidden.is_inference()
        assert r.final_hidden._base is None
        with torch.no_grad():
            logits = tiny.lm_head(r.final_hidden.float())
        assert torch.allclose(logits, out.logits[0], atol=0.02, rtol=0.02)
        assert torch.equal(logits.argmax(-1), out.logits[0].argmax(-1))


def test_topk_restricted_to_draft_vocab(tiny):
    t2d = _t2d(512, seed=2)
    samples = _samples(4, 512, 5, 30, seed=3)
    settings = ExtractSettings(aux_layer_ids=[1, 2, 3], teacher="topk", topk=7)
    res = HFExtractor(tiny, settings, t2d=t2d).extract(samples)
    for (ids, _), r in zip(samples, res):
        assert isinstance(r, Extracted) and r.final_hidden is None
        assert r.topk_ids.dtype == torch.int32 and r.topk_ids.shape == (len(ids), 7)
        assert r.topk_logprobs.dtype == torch.float16
        assert bool(t2d[r.topk_ids.long()].all())
        logits = _direct(tiny, ids).logits[0]
        draft = torch.log_softmax(logits[:, t2d], dim=-1)  # renormalised over the draft vocab
        want, pos = draft.topk(7, dim=-1)
        assert torch.equal(r.topk_ids.long(), torch.nonzero(t2d).squeeze(1)[pos])
        torch.testing.assert_close(r.topk_logprobs.float(), want, atol=2e-3, rtol=2e-3)
        assert bool((r.topk_logprobs[:, :-1] >= r.topk_logprobs[:, 1:]).all())
        assert torch.equal(r.argmax_in_draft, t2d[logits.argmax(-1)])
    assert any(not bool(r.argmax_in_draft.all()) for r in res)  # a quarter-vocab draft misses some argmaxes


def test_batched_equals_one_by_one_and_order_kept(tiny):
    samples = _samples(9, 512, 1, 50, seed=4)
    settings = ExtractSettings(aux_layer_ids=[0, 2, 4])
    big = HFExtractor(tiny, settings, max_batch_tokens=100_000)
    assert len(big.batches(samples)) == 1
    batched = big.extract(samples)
    single = HFExtractor(tiny, settings, max_batch_tokens=1).extract(samples)
    for a, b, (ids, _) in zip(batched, single, samples):
        assert a.input_ids.tolist() == b.input_ids.tolist() == ids
        torch.testing.assert_close(a.aux_hidden.float(), b.aux_hidden.float(), atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(a.final_hidden.float(), b.final_hidden.float(), atol=1e-2, rtol=1e-2)


def test_nan_in_one_sample_quarantines_exactly_that_sample(tiny):
    samples = _samples(4, 512, 6, 20, seed=5)
    target_ids = samples[2][0]

    def poison(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        for b in range(hidden.shape[0]):
            if hook_batch_ids[b, : len(target_ids)].tolist() == target_ids:
                hidden[b, 1, :3] = float("nan")
        return output

    hook_batch_ids = None

    def grab(module, args, kwargs):
        nonlocal hook_batch_ids
        hook_batch_ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]

    h1 = tiny.base_model.register_forward_pre_hook(grab, with_kwargs=True)
    h2 = tiny.base_model.layers[2].register_forward_hook(poison)
    try:
        res = HFExtractor(tiny, ExtractSettings(aux_layer_ids=[0, 2, 4], storage="fp8"),
                          max_batch_tokens=10_000).extract(samples)
    finally:
        h1.remove()
        h2.remove()
    assert [type(r) for r in res] == [Extracted, Extracted, Quarantined, Extracted]
    assert res[2].index == 2
    # layer 2 gets 3 NaNs; they spread through attention and MLP into layer 4 and the final state
    assert "3 non-finite values in aux layer 2 (hidden_states[3])" in res[2].reason
    assert "aux layer 4" in res[2].reason and "final_hidden" in res[2].reason
    assert "aux layer 0 " not in res[2].reason
    for r in (res[0], res[1], res[3]):
        assert torch.isfinite(dequantize_fp8(r.aux_hidden, r.aux_scale)).all()


def test_invalid_samples():
    ex = HFExtractor(_tiny(), ExtractSettings(aux_layer_ids=[0, 2, 4]))
    res = ex.extract([([], []), ([1, 2, 600], [1, 1, 1]), ([5, 6], [0, 1])])
    assert isinstance(res[0], Quarantined) and "empty" in res[0].reason
    assert isinstance(res[1], Quarantined) and "outside the target vocab" in res[1].reason
    assert isinstance(res[2], Extracted) and res[2].index == 2
    with pytest.raises(ValueError, match="loss-mask"):
        ex.extract([([1, 2], [1])])


def test_fp8_roundtrip():
    x = torch.randn(10, 192) * torch.logspace(-2, 2, 10).unsqueeze(1)
    x[3] = 0
    q, s = quantize_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (10,)
    torch.testing.assert_close(s, x.abs().amax(-1) / 448)
    back = dequantize_fp8(q, s)
    assert torch.equal(back[3], torch.zeros(192))
    rel = (back - x).norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-30)
    assert rel.max() < 0.04  # e4m3 has 3 mantissa bits: ~2-3% per-token norm error
    assert torch.equal(back.abs().amax(-1), x.abs().amax(-1))  # the absmax element is exact


# ---- SmolLM2: realistic states --------------------------------------------------------------------

def test_smollm2_aux_final_topk_and_batching(smol):
    L = smol.config.num_hidden_layers
    aux_ids = default_aux_layer_ids(L)
    samples = _samples(3, smol.config.vocab_size, 20, 64, seed=6)
    t2d = _t2d(smol.config.vocab_size, seed=7)
    fh = HFExtractor(smol, ExtractSettings(aux_layer_ids=aux_ids), max_batch_tokens=10_000).extract(samples)
    tk = HFExtractor(smol, ExtractSettings(aux_layer_ids=aux_ids, teacher="topk", storage="fp8"), t2d=t2d,
                     max_batch_tokens=1).extract(samples)
    for (ids, _), a, b in zip(samples, fh, tk):
        out = _direct(smol, ids)
        hs = out.hidden_states
        want = torch.cat([hs[j + 1][0] for j in aux_ids], dim=-1).float()
        # batched bf16 vs the one-sample direct forward: bf16 kernels round differently per shape
        rel = (a.aux_hidden.float() - want).norm() / want.norm()
        assert rel < 2e-2, rel
        assert (a.final_hidden.float() - hs[-1][0].float()).norm() / hs[-1][0].float().norm() < 2e-2
        # one-by-one equals the direct forward exactly, up to fp8 rounding (3 mantissa bits)
        fp8 = dequantize_fp8(b.aux_hidden, b.aux_scale)
        assert (fp8 - want).norm(dim=-1).div(want.norm(dim=-1)).max() < 0.05
        with torch.no_grad():
            logits = smol.lm_head(a.final_hidden)
        # The choice from the batched state is the direct forward's best up to bf16 rounding. Not an
        # agreement rate: bf16 logits on these random inputs tie exactly at ~5-10% of positions, and
        # which of a tie wins depends on the CPU's bf16 rounding per shape. A shifted or mixed-up
        # position misses the best by several nats.
        direct = torch.log_softmax(out.logits[0].float(), -1)
        gaps = direct.max(-1).values - direct.gather(1, logits.argmax(-1, keepdim=True)).squeeze(1)
        assert float(gaps.max()) < 1.0, gaps
        assert bool(t2d[b.topk_ids.long()].all())
        draft = torch.log_softmax(out.logits[0].float()[:, t2d], dim=-1)
        got = draft.gather(1, torch.searchsorted(torch.nonzero(t2d).squeeze(1), b.topk_ids.long()))
        torch.testing.assert_close(b.topk_logprobs.float(), got, atol=0.15, rtol=0.02)  # fp32 vs bf16 logits


def _full_vocab_topk(model, final: torch.Tensor, t2d: torch.Tensor, k: int):
    """The top-k teacher as first written: full float32 logits, log_softmax over the draft ids, full argmax."""
    logits = torch.nn.functional.linear(final.float(), model.get_output_embeddings().weight.float())
    draft_ids = torch.nonzero(t2d).squeeze(1)
    values, pos = torch.log_softmax(logits[:, draft_ids], dim=-1).topk(k, dim=-1)
    return draft_ids[pos], values, t2d[logits.argmax(dim=-1)]


def test_topk_teacher_equals_the_full_vocab_computation(smol):
    """Two matmuls and a log-sum-exp give the full-vocab numbers: same ids and argmax bits, logprobs to fp16."""
    t2d = torch.zeros(smol.config.vocab_size, dtype=torch.bool)
    t2d[torch.randperm(smol.config.vocab_size, generator=torch.Generator().manual_seed(8))[:8192]] = True
    samples = _samples(3, smol.config.vocab_size, 40, 90, seed=9)
    settings = ExtractSettings(aux_layer_ids=default_aux_layer_ids(smol.config.num_hidden_layers), teacher="topk",
                               topk=20)
    extractor = HFExtractor(smol, settings, t2d=t2d)
    for (ids, _), fh in zip(samples, HFExtractor(smol, ExtractSettings(aux_layer_ids=settings.aux_layer_ids))
                            .extract(samples)):
        rec = Extracted(index=0, input_ids=torch.tensor(ids), loss_mask=torch.ones(len(ids)), aux_hidden=None)
        assert extractor.teacher.fill(fh.final_hidden, rec) is None
        want_ids, want_lp, want_in_draft = _full_vocab_topk(smol, fh.final_hidden, t2d, 20)
        assert torch.equal(rec.topk_ids.long(), want_ids)
        torch.testing.assert_close(rec.topk_logprobs.float(), want_lp.half().float(), atol=1e-6, rtol=2 ** -10)
        assert torch.equal(rec.argmax_in_draft, want_in_draft)
        assert 0 < int(want_in_draft.sum()) < len(ids)  # a random 8K draft vocab misses some argmaxes


@pytest.mark.parametrize("draft_is_lower", [True, False])
def test_topk_teacher_tie_goes_to_the_lower_target_id(draft_is_lower):
    """A draft and a non-draft token with the same best logit: the lower target id is the argmax."""
    model = _tiny()
    t2d = _t2d(512, seed=2)
    draft_id, other_id = int(torch.nonzero(t2d)[5]), int(torch.nonzero(~t2d)[5])
    head = model.get_output_embeddings().weight
    direction = torch.randn(64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        head[draft_id] = head[other_id] = direction * 10  # the same row: the same logit, the largest
    if (draft_id < other_id) != draft_is_lower:  # swap roles by renaming which id is drafted
        t2d[draft_id], t2d[other_id] = False, True
    final = direction[None].repeat(2, 1)
    rec = Extracted(index=0, input_ids=torch.zeros(2, dtype=torch.int32), loss_mask=torch.ones(2), aux_hidden=None)
    extractor = HFExtractor(model, ExtractSettings(aux_layer_ids=[1, 2, 3], teacher="topk", topk=3), t2d=t2d)
    assert extractor.teacher.fill(final, rec) is None
    _, _, want = _full_vocab_topk(model, final, t2d, 3)
    assert torch.equal(rec.argmax_in_draft, want)
    assert bool(want.all()) == draft_is_lower
