"""Offline acceptance: known answers (oracle k+1, random draft ~1), greedy outputs unchanged by every
drafter, the decode chain equal to TTT's steps, the final-state baseline skipping fc, prompt lookup,
token-weighted vs per-request means, chat-templated prompts, and a short run on real SmolLM2."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch

from benchmarks.fixtures import chat_prompts, random_draft
from tasks.model.draft import Eagle3Draft
from tasks.evaluate.offline import (HUMANEVAL, AcceptanceReport, BenchPrompt, Drafter, Eagle3Drafter, LossyDecoding,
                            OracleDrafter, PromptLookupDrafter, RequestResult, TargetState, aggregate,
                            benchmark_sets, check_lossless, draft_chain_logits, evaluate_acceptance,
                            first_difference, load_draft_for_target, offline_acceptance, prompts_for_benchmark,
                            speculative_generate, target_greedy)

TARGET_CACHE = Path(tempfile.gettempdir()) / "eagle3-test-targets"  # shared with the other test modules
V, H, N_DRAFT, LAYERS, AUX = 512, 64, 128, 6, (1, 2, 4)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=V)
    return LlamaForCausalLM(config).eval()


def _draft(target, n_draft: int = N_DRAFT, aux=AUX, seed: int = 1, **shape) -> Eagle3Draft:
    return random_draft(target, n_draft, aux, seed, **shape)


def _prompts(n: int, seed: int = 0) -> list[BenchPrompt]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(6, 20, (1,), generator=g))
        ids = torch.randint(0, V, (length,), generator=g).tolist()
        out.append(BenchPrompt("a" if i % 2 else "b", f"p{i}", "", ids))
    return out


def test_oracle_drafter_is_accepted_in_full(tiny):
    k, rounds = 3, 4
    prompt = _prompts(1)[0].input_ids
    max_new = 1 + rounds * (k + 1)  # the prefill's token, then `rounds` full rounds
    r = speculative_generate(tiny, prompt, OracleDrafter(tiny), k, max_new)
    assert r.output_ids == target_greedy(tiny, prompt, max_new)
    assert r.verify_rounds == rounds and r.finish_reason == "length"
    assert r.accepted_by_position == [rounds] * k and r.committed_drafts == rounds * k
    assert r.tokens_per_verify_round == k + 1  # SGLang's `accept len`
    assert r.acceptance_length == max_new / rounds  # completion / spec_verify_ct: the prefill token on top
    only_prefill = speculative_generate(tiny, prompt, OracleDrafter(tiny), k, 1)
    assert (only_prefill.verify_rounds, only_prefill.acceptance_length) == (0, None)  # no speculation: no number


def test_random_draft_is_accepted_about_once_per_round(tiny):
    report = evaluate_acceptance(tiny, _prompts(4), [Eagle3Drafter(_draft(tiny))], k=4, max_new_tokens=24)
    agg = report.get("eagle3")
    assert 1.0 <= agg.acceptance_length_token_weighted <= 1.2
    assert 1.0 <= agg.tokens_per_verify_round <= 1.2


def test_every_drafter_leaves_greedy_output_unchanged_stop_ids_included(tiny):
    draft = _draft(tiny)
    drafters: list[Drafter] = [OracleDrafter(tiny), Eagle3Drafter(draft), Eagle3Drafter(draft, "final"),
                               PromptLookupDrafter()]
    assert all(isinstance(d, Drafter) for d in drafters)
    prompts = _prompts(3, seed=1)
    # Repetitive text, so prompt lookup proposes (and gets some accepted) instead of idling.
    prompts.append(BenchPrompt("rep", "rep", "", [7, 8, 9, 10, 11] * 4))
    results = []
    for p in prompts:
        ref = target_greedy(tiny, p.input_ids, 20)
        for d in drafters:
            r = speculative_generate(tiny, p.input_ids, d, 4, 20, domain=p.domain, item_id=p.item_id)
            results.append(r)
            assert r.output_ids == ref, d.name
            # The target decoded with a KV cache gives what a full recompute each step gives.
            assert speculative_generate(tiny, p.input_ids, d, 4, 20, domain=p.domain, item_id=p.item_id,
                                        recompute=True) == r, d.name
        stop = {ref[9]}  # a stop id inside the output: decoding ends on its first occurrence, which is kept
        ref_stop = ref[:ref.index(ref[9]) + 1]
        assert target_greedy(tiny, p.input_ids, 20, stop) == ref_stop
        for d in drafters:
            r = speculative_generate(tiny, p.input_ids, d, 4, 20, stop)
            assert (r.output_ids, r.finish_reason, r.completion_tokens) == (ref_stop, "stop", len(ref_stop)), d.name
    report = AcceptanceReport.build(4, 20, results)
    assert report.get("prompt-lookup", "rep").tokens_per_verify_round > 1.0
    assert report.get("oracle").tokens_per_verify_round > 4.0


@pytest.mark.parametrize("norms", [{}, {"norm_before_fc": True, "norm_output": True}, {"norm_output": True}],
                         ids=["eagle3", "eagle3.1-norms", "norm-output-only"])
def test_decode_chain_equals_ttt_steps_under_teacher_forcing(tiny, norms):
    """Step j at the last context position, fed the true tokens, is TTT step j at that position (with the
    Eagle 3.1 norms too: the serving-time chain and training apply them at the same places)."""
    draft = _draft(tiny, **norms)
    with torch.no_grad():  # norm weights that are not all ones, so that a norm skipped on one side shows
        for name, p in draft.named_parameters():
            if name in ("norm.weight", "input_norm.weight"):
                p.copy_(torch.rand(p.shape, generator=torch.Generator().manual_seed(7)) + 0.5)
    ids = torch.randint(0, V, (1, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        states = tiny(input_ids=ids, output_hidden_states=True).hidden_states
        aux = torch.cat([states[i + 1] for i in AUX], dim=-1)
        ttt = [logits[0] for _, logits in draft.steps(aux, ids, steps=4)]
        for t in (3, 9):
            chain = draft_chain_logits(draft, draft.fuse(aux[0, :t + 1]), ids[0, :t + 2], 4,
                                       forced=ids[0, t + 2:t + 5].tolist())
            for j in range(4):
                torch.testing.assert_close(chain[j], ttt[j][t], atol=1e-5, rtol=1e-4)
        # Free-running proposals are the argmax chain of the same recurrence.
        state = TargetState(ids[0, :11], tuple(h[0, :10] for h in states))
        proposals = Eagle3Drafter(draft).propose(state, 3)
        chain = draft_chain_logits(draft, draft.fuse(aux[0, :10]), ids[0, :11], 3, forced=proposals[:2])
    assert proposals == [int(draft.draft_to_target[c.argmax()]) for c in chain]


def test_final_state_baseline_feeds_the_final_state_in_place_of_fc(tiny):
    draft = _draft(tiny)
    ids = torch.randint(0, V, (12,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        states = tuple(h[0, :11] for h in tiny(input_ids=ids[None], output_hidden_states=True).hidden_states)
    state = TargetState(ids, states)
    final, eagle3 = Eagle3Drafter(draft, "final"), Eagle3Drafter(draft)
    assert final.name != eagle3.name
    before = (final.propose(state, 4), eagle3.propose(state, 4))
    expected = [int(draft.draft_to_target[c.argmax()]) for c in draft_chain_logits(draft, states[-1], ids, 4)]
    assert before[0] == expected
    with torch.no_grad():
        draft.fc.weight.mul_(-3.0)
    assert final.propose(state, 4) == before[0]  # fc is never used
    assert eagle3.propose(state, 4) != before[1]


def test_greedy_paths_kept_on_disk_measure_exactly_as_decoded_and_refuse_a_layer_not_kept(tiny, tmp_path):
    from tasks.evaluate.decoding import greedy_path
    from tasks.evaluate.path_cache import load_paths, save_paths

    draft, prompts = _draft(tiny), _prompts(3, seed=2)
    paths = {p.item_id: greedy_path(tiny, p.input_ids, 12) for p in prompts}
    file = tmp_path / "paths.safetensors"
    save_paths(file, paths, [i + 1 for i in AUX] + [-1])
    read = load_paths(file)
    assert list(read) == list(paths) and load_paths(tmp_path / "none.safetensors") == {}
    for item_id, p in paths.items():
        q = read[item_id]
        assert (q.prompt_tokens, q.finish_reason) == (p.prompt_tokens, p.finish_reason)
        assert torch.equal(q.tokens, p.tokens)
        for i in [*(a + 1 for a in AUX), LAYERS]:  # kept bit for bit, float32 stays float32
            assert q.hidden_states[i].dtype == torch.float32 and torch.equal(q.hidden_states[i], p.hidden_states[i])
    fresh = evaluate_acceptance(tiny, prompts, [Eagle3Drafter(draft), Eagle3Drafter(draft, "final")], 3, 12)
    cached = evaluate_acceptance(tiny, prompts, [Eagle3Drafter(draft), Eagle3Drafter(draft, "final")], 3, 12,
                                 paths=read)
    assert cached.requests == fresh.requests
    other = _draft(tiny, aux=(0, 3, 4))  # reads layers the file does not hold: an error naming the layer
    with pytest.raises(LookupError, match="hidden layer 1 of the greedy path was not kept"):
        evaluate_acceptance(tiny, prompts, [Eagle3Drafter(other)], 3, 12, paths=read)
    file.write_bytes(b"")
    with pytest.raises(Exception):
        load_paths(file)


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    pl = PromptLookupDrafter(max_ngram=3)

    def s(toks: list[int]) -> TargetState:
        return TargetState(torch.tensor(toks), ())

    assert pl.propose(s([5, 6, 7, 8, 9, 5, 6, 7]), 3) == [8, 9, 5]
    assert pl.propose(s([1, 2, 3, 1, 2, 4, 1, 2]), 2) == [4, 1]  # newest earlier [1, 2], not the first
    assert pl.propose(s([1, 2, 3, 4]), 3) == []


def test_token_weighted_and_request_mean_differ_and_are_labelled():
    def req(tokens: int, rounds: int, domain: str) -> RequestResult:
        return RequestResult("d", domain, f"{domain}{tokens}", 5, tokens, rounds, tokens - 1 - rounds,
                             [rounds, 0], [rounds, rounds], "length", [0] * tokens)

    rows = [req(11, 2, "x"), req(4, 3, "y")]
    agg = aggregate(rows, "d", "all")
    assert agg.acceptance_length_token_weighted == pytest.approx(15 / 5)
    assert agg.acceptance_length_request_mean == pytest.approx((11 / 2 + 4 / 3) / 2)
    assert agg.accepted_by_position == [5, 0] and agg.position_accept_rate == [1.0, 0.0]
    report = AcceptanceReport.build(2, 11, rows)
    assert [(a.domain, a.requests) for a in report.aggregates] == [("all", 2), ("x", 1), ("y", 1)]
    table = report.to_rows()
    assert {"acceptance_length_token_weighted", "acceptance_length_request_mean", "accept_rate_pos2"} <= set(table[0])
    json.dumps(report.to_dict())
    assert "AL tok-wt" in report.format_table()


@pytest.fixture(scope="module")
def smol():
    """float32: the short run compares greedy outputs decoded in chunks of k+1 with one-token decoding,
    which in bf16 round differently per shape and per CPU, so near-ties could flip."""
    from tasks.model.target import load_target

    return load_target(cache_dir=TARGET_CACHE, dtype=torch.float32)


def test_benchmark_prompts_are_chat_templated(smol, tmp_path):
    _, tok = smol
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"question": "What is 2+2?"},
        {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "recorded"}]},
    ]) + "\n")
    prompts = prompts_for_benchmark(tok, None, benchmark_sets(files=[("mine", path)]), limit=2)
    assert [p.domain for p in prompts] == [HUMANEVAL, HUMANEVAL, "mine", "mine"]
    for p in prompts:
        assert p.text.startswith("<|im_start|>") and p.text.endswith("<|im_start|>assistant\n")
        assert p.input_ids == tok(p.text, add_special_tokens=False)["input_ids"]
    assert "def has_close_elements" in prompts[0].text
    assert "recorded" not in prompts[3].text  # the target writes its own answer
    assert prompts[2].input_ids == tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}],
                                                           add_generation_prompt=True, tokenize=True,
                                                           return_dict=True)["input_ids"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps({"answer": "no prompt"}) + "\n")
    with pytest.raises(ValueError, match="line 2: no prompt"):
        benchmark_sets(humaneval=False, files=[("bad", bad)])
    with pytest.raises(ValueError, match="CONTRACTS failure 10"):
        prompts_for_benchmark(type("NoTemplate", (), {"chat_template": None})(), None, [("x", ["hi"])])


def test_exported_draft_loads_for_its_target_and_proposes_the_same(tiny, tmp_path):
    from serving.sglang.export import export_sglang

    draft = _draft(tiny)
    folder = export_sglang(draft, tmp_path / "draft", dtype=torch.float32)
    loaded = load_draft_for_target(folder, tiny)
    ids = torch.randint(0, V, (12,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        states = tuple(h[0, :11] for h in tiny(input_ids=ids[None], output_hidden_states=True).hidden_states)
    state = TargetState(ids, states)
    assert Eagle3Drafter(loaded).propose(state, 4) == Eagle3Drafter(draft).propose(state, 4)


def test_short_run_on_smollm2(smol):
    from tasks.model.target import stop_token_ids

    model, tok = smol
    draft = _draft(model, n_draft=2048, aux=(1, 14, 26))
    # The baselines run on the tiny target above; here one drafter keeps the real model's forwards few.
    report = offline_acceptance(model, tok, draft, limit=2, k=3, max_new_tokens=16, baselines=False)
    assert report.drafters == ["eagle3"]
    stops = stop_token_ids(model, tok)
    for p in prompts_for_benchmark(tok, None, benchmark_sets(), limit=2):
        ref = target_greedy(model, p.input_ids, 16, stops)
        assert [r.output_ids for r in report.requests if r.item_id == p.item_id] == [ref]
    assert 1.0 <= report.get("eagle3").acceptance_length_token_weighted <= 1.2
    assert report.get("eagle3", HUMANEVAL).requests == 2
    json.dumps(report.to_dict())


def test_a_difference_from_the_greedy_output_is_an_error_naming_drafter_prompt_and_position():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2  # stopped early: differs where it ended
    ok = RequestResult("d", "x", "x/0", 3, 3, 2, 1, [1], [2], "length", [7, 8, 9])
    bad = RequestResult("prompt-lookup", "x", "x/1", 3, 3, 2, 1, [1], [2], "length", [7, 4, 9])
    assert check_lossless([ok], {"x/0": [7, 8, 9]}) == 1
    with pytest.raises(LossyDecoding, match=r"prompt-lookup on x/1: differs from the target's greedy output at new "
                                            r"token 1 \(speculative 4, greedy 8\)") as err:
        check_lossless([ok, bad], {"x/0": [7, 8, 9], "x/1": [7, 8, 9]})
    assert "1 of 2 outputs" in str(err.value)


@pytest.fixture(scope="module")
def smol_bf16():
    from tasks.model.target import load_target

    return load_target(cache_dir=TARGET_CACHE)  # the default dtype, bf16: its rounding depends on the CPU


@pytest.mark.timeout(900)
def test_every_drafter_is_lossless_on_smollm2_chat_and_code(smol_bf16):
    """24 prompts (12 ShareGPT chat, 12 HumanEval), 64 new tokens, the EAGLE-3 draft, the same draft on
    the final state, and prompt lookup, at k = 3 and 4, on the bf16 target: every output is the
    target's plain greedy decoding (target_greedy, run separately) token for token. bf16 is where
    verifying k+1 tokens in one forward used to flip near-ties; this holds on any CPU."""
    from tasks.model.target import stop_token_ids

    model, tok = smol_bf16
    assert model.dtype == torch.bfloat16
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the module runs on one thread; this test is mostly SmolLM2 forwards
    try:
        sets = [("chat", chat_prompts(12)), (HUMANEVAL, benchmark_sets()[0][1][:12])]
        prompts = prompts_for_benchmark(tok, None, sets)
        assert len(prompts) == 24
        stops = stop_token_ids(model, tok)
        reference = {p.item_id: target_greedy(model, p.input_ids, 64, stops) for p in prompts}
        draft = _draft(model, n_draft=2048, aux=(1, 14, 26))  # float32 on CPU, as offline_acceptance runs it
        drafters = [Eagle3Drafter(draft, "aux"), Eagle3Drafter(draft, "final"), PromptLookupDrafter()]
        paths: dict = {}
        for k in (3, 4):
            report = evaluate_acceptance(model, prompts, drafters, k, 64, stops, paths=paths, reference=reference)
            assert report.lossless_checked == 24 * 3
            assert [r.output_ids for r in report.requests] == [reference[p.item_id] for _ in drafters for p in prompts]
            # work was checked: prompt lookup's drafts were accepted, and every drafter ran many rounds
            assert report.get("prompt-lookup").tokens_per_verify_round > 1.0
            assert sum(r.verify_rounds for r in report.requests) > 24 * 3 * 10
    finally:
        torch.set_num_threads(threads)
    assert len(paths) == 24  # one plain decoding per prompt served both k
