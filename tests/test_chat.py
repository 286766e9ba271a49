"""Tests of tasks.extract.chat on the real SmolLM2 tokenizer (loaded from the GGUF) and, once, the real llama.cpp server."""

from __future__ import annotations

import httpx
import pytest

from tasks.extract.chat import (Mismatch, Sample, Skipped, carry_mask, check_against_server_ids, mismatch_report, prompt_messages,
                        render_and_mask, template_supports_reasoning, tokenise_generation)
from tasks.model.target import gguf_chat_template, smollm2_gguf_path

SYSTEM_DEFAULT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
THREE_TURNS = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome is the capital of Italy."},
    {"role": "user", "content": "Thanks! One more: Spain?"},
    {"role": "assistant", "content": "Madrid, on the Manzanares river."},
]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    gguf = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)


def _template_ids(tok, messages, add_generation_prompt: bool) -> list[int]:
    return list(tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                        add_generation_prompt=add_generation_prompt)["input_ids"])


def _runs(mask: list[int], value: int) -> list[tuple[int, int]]:
    """Maximal [start, end) runs of `value` in the mask."""
    runs, start = [], None
    for i, m in enumerate(mask + [1 - value]):
        if m == value and start is None:
            start = i
        elif m != value and start is not None:
            runs.append((start, i))
            start = None
    return runs


def test_three_turn_masks_are_exactly_the_assistant_contents_and_their_end_tokens(tok):
    s = render_and_mask(tok, THREE_TURNS, 4096)
    assert isinstance(s, Sample)
    assert s.input_ids == _template_ids(tok, THREE_TURNS, False)  # the whole text is the template's rendering
    assert len(s.loss_mask) == len(s.input_ids) and set(s.loss_mask) == {0, 1}

    masked = [tok.decode(s.input_ids[a:b]) for a, b in _runs(s.loss_mask, 1)]
    assert masked == [m["content"] + "<|im_end|>" for m in THREE_TURNS if m["role"] == "assistant"]
    for a, b in _runs(s.loss_mask, 1):
        assert s.input_ids[b - 1] == tok.eos_token_id  # each span ends on the end-of-turn token

    unmasked = [tok.decode(s.input_ids[a:b]) for a, b in _runs(s.loss_mask, 0)]
    assert unmasked == [
        f"<|im_start|>system\n{SYSTEM_DEFAULT}<|im_end|>\n<|im_start|>user\n{THREE_TURNS[0]['content']}<|im_end|>\n"
        "<|im_start|>assistant\n",
        f"\n<|im_start|>user\n{THREE_TURNS[2]['content']}<|im_end|>\n<|im_start|>assistant\n",
        f"\n<|im_start|>user\n{THREE_TURNS[4]['content']}<|im_end|>\n<|im_start|>assistant\n",
        "\n",
    ]


def test_the_prompt_part_equals_what_a_server_tokenises(tok):
    s = render_and_mask(tok, THREE_TURNS, 4096)
    prompt_ids = _template_ids(tok, prompt_messages(THREE_TURNS), True)
    assert s.input_ids[:len(prompt_ids)] == prompt_ids
    assert s.loss_mask[len(prompt_ids) - 1] == 0 and s.loss_mask[len(prompt_ids)] == 1  # header unmasked, content masked
    # The default system prompt is the template's own: an explicit system turn replaces it.
    with_system = render_and_mask(tok, [{"role": "system", "content": "Be brief."}, *THREE_TURNS], 4096)
    assert SYSTEM_DEFAULT in tok.decode(s.input_ids) and SYSTEM_DEFAULT not in tok.decode(with_system.input_ids)
    assert with_system.input_ids == _template_ids(tok, [{"role": "system", "content": "Be brief."}, *THREE_TURNS], False)


def test_the_gguf_template_is_the_tokenizers_template(tok):
    assert tok.chat_template == gguf_chat_template(smollm2_gguf_path())
    a = render_and_mask(tok, THREE_TURNS, 4096)
    b = render_and_mask(tok, THREE_TURNS, 4096, chat_template=gguf_chat_template(smollm2_gguf_path()))
    assert a == b


def test_truncate_cuts_and_counts_and_drop_skips(tok):
    full = render_and_mask(tok, THREE_TURNS, 4096)
    n = full.num_tokens
    cut = render_and_mask(tok, THREE_TURNS, n - 5, "truncate")
    assert isinstance(cut, Sample)
    assert cut.input_ids == full.input_ids[:n - 5] and cut.loss_mask == full.loss_mask[:n - 5]
    assert cut.truncated_tokens == 5 and cut.truncated_masked_tokens == sum(full.loss_mask[n - 5:]) == 4
    exact = render_and_mask(tok, THREE_TURNS, n, "drop")
    assert exact == full and exact.truncated_tokens == 0

    dropped = render_and_mask(tok, THREE_TURNS, n - 1, "drop")
    assert isinstance(dropped, Skipped) and dropped.num_tokens == n and str(n) in dropped.reason

    # Cut before the first assistant token: nothing to train on.
    first_masked = full.loss_mask.index(1)
    nothing = render_and_mask(tok, THREE_TURNS, first_masked, "truncate")
    assert isinstance(nothing, Skipped) and "no assistant token" in nothing.reason
    with pytest.raises(ValueError):
        render_and_mask(tok, THREE_TURNS, 100, "wrap")


def test_special_strings_typed_by_a_user_do_not_shift_the_mask(tok):
    typed = [{"role": "user", "content": "What does <|im_end|> mean? And <|im_start|>assistant\nhi"},
             {"role": "assistant", "content": "It ends a turn in ChatML."}]
    s = render_and_mask(tok, typed, 4096)
    assert isinstance(s, Sample)
    # The typed string becomes the special id, as in the server's tokenisation of the same text ...
    assert s.input_ids == _template_ids(tok, typed, False)
    assert s.input_ids.count(tok.eos_token_id) == 4  # system, the typed one, user end, assistant end
    # ... yet the mask is still exactly the assistant content and its one end-of-turn token.
    [(a, b)] = _runs(s.loss_mask, 1)
    assert tok.decode(s.input_ids[a:b]) == "It ends a turn in ChatML.<|im_end|>"
    assert s.input_ids[a - 4:a] == tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]


def test_special_strings_in_assistant_text_are_skipped_with_a_reason(tok):
    said = [{"role": "user", "content": "Show me the ChatML end token."},
            {"role": "assistant", "content": "It is <|im_end|>, written literally."}]
    s = render_and_mask(tok, said, 4096)
    assert isinstance(s, Skipped) and "<|im_end|>" in s.reason and "turn 1" in s.reason


def test_a_conversation_without_a_prompt_is_skipped(tok):
    assert render_and_mask(tok, [{"role": "user", "content": "hi"}], 4096) == Skipped("no assistant turn")
    s = render_and_mask(tok, [{"role": "assistant", "content": "Hello!"}, *THREE_TURNS], 4096)
    assert isinstance(s, Skipped) and "starts with an assistant turn" in s.reason


def test_a_token_across_the_header_boundary_is_skipped(tok):
    # "assistant\n" + "\n\nHi" tokenises with the newlines merged across the header: the server,
    # which tokenises the prompt up to the header alone, would never see that token.
    s = render_and_mask(tok, [{"role": "user", "content": "x"}, {"role": "assistant", "content": "\n\nHi"}], 4096)
    assert isinstance(s, Skipped) and "straddles" in s.reason


def test_reasoning_the_template_cannot_render_is_skipped_not_dropped(tok):
    assert not template_supports_reasoning(tok)
    msgs = [{"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "two plus two is four"}]
    s = render_and_mask(tok, msgs, 4096)
    assert isinstance(s, Skipped) and "reasoning" in s.reason
    msgs[1]["reasoning_content"] = ""  # an empty field loses nothing
    assert isinstance(render_and_mask(tok, msgs, 4096), Sample)


def test_a_template_that_renders_reasoning_gets_it_masked(tok):
    # A minimal thinking template (ChatML with <think> blocks): the reasoning is part of the turn.
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                "{% if m.get('reasoning_content') %}<think>{{ m['reasoning_content'] }}</think>{% endif %}"
                "{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    msgs = [{"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "two plus two"}]
    s = render_and_mask(tok, msgs, 4096, chat_template=template)
    assert isinstance(s, Sample)
    [(a, b)] = _runs(s.loss_mask, 1)
    assert tok.decode(s.input_ids[a:b]) == "<think>two plus two</think>4<|im_end|>"


def test_a_template_that_rewrites_history_is_skipped(tok):
    # Drops earlier assistant turns' content, as thinking templates drop earlier reasoning:
    # prefix renders no longer line up with the full render.
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                "{% if m['role'] != 'assistant' or loop.last %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    s = render_and_mask(tok, THREE_TURNS, 4096, chat_template=template)
    assert isinstance(s, Skipped) and "prefix" in s.reason


def test_the_mismatch_check_finds_a_one_token_difference(tok):
    s = render_and_mask(tok, THREE_TURNS, 4096)
    prompt = _template_ids(tok, prompt_messages(THREE_TURNS), True)
    completion = tok(THREE_TURNS[-1]["content"], add_special_tokens=False)["input_ids"]
    assert check_against_server_ids(s, prompt, completion) is None
    assert check_against_server_ids(s, prompt, completion + [tok.eos_token_id]) is None

    bad_prompt = list(prompt)
    bad_prompt[7] += 1
    assert check_against_server_ids(s, bad_prompt, completion) == Mismatch(7, "prompt", prompt[7] + 1, prompt[7])
    bad_completion = list(completion)
    bad_completion[2] += 1
    m = check_against_server_ids(s, prompt, bad_completion)
    assert m == Mismatch(len(prompt) + 2, "completion", completion[2] + 1, completion[2])
    short = render_and_mask(tok, THREE_TURNS, len(prompt) + 1)
    assert check_against_server_ids(short, prompt, completion) == Mismatch(len(prompt) + 1, "completion", completion[1], None)

    report = mismatch_report([(s, prompt, completion), (s, prompt, bad_completion), (s, bad_prompt, completion)])
    assert report.checked == 3 and report.mismatched == 2 and report.rate == pytest.approx(2 / 3)
    assert report.first == (1, m)
    assert mismatch_report([]).rate == 0.0


@pytest.mark.slow  # starts a server: not in `make test-fast`
def test_prompt_tokens_equal_the_llama_cpp_servers_count(tok, tmp_path):
    from serving.llamacpp.server import LlamaCppServer

    conversations = [THREE_TURNS[:2], THREE_TURNS,
                     [{"role": "system", "content": "Be brief."}, *THREE_TURNS[:4]],
                     [{"role": "user", "content": "Typed <|im_end|> here"}, {"role": "assistant", "content": "ok"}]]
    with LlamaCppServer(smollm2_gguf_path(), port=0, n_ctx=2048, n_threads=2, log_path=tmp_path / "s.log") as server:
        for conv in conversations:
            s = render_and_mask(tok, conv, 4096)
            assert isinstance(s, Sample)
            prompt = prompt_messages(conv)
            body = {"messages": prompt, "max_tokens": 1, "temperature": 0, "repeat_penalty": 1.0}
            r = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)
            r.raise_for_status()
            # The served prompt is our rendering up to the last assistant header, token for token in count.
            assert r.json()["usage"]["prompt_tokens"] == s.loss_mask.index(1, _last_header(s)) == \
                len(_template_ids(tok, prompt, True))


def _last_header(s: Sample) -> int:
    """Index of the first token of the last masked run: the last assistant turn's start."""
    return _runs(s.loss_mask, 1)[-1][0]


def test_generation_samples_use_the_servers_ids_where_they_differ(tok):
    prompt = _template_ids(tok, prompt_messages(THREE_TURNS), True)
    completion = tok(THREE_TURNS[-1]["content"], add_special_tokens=False)["input_ids"]
    ours = render_and_mask(tok, THREE_TURNS, 4096)
    turn = {"prompt_token_ids": prompt, "completion_token_ids": completion, "finish_reason": "stop"}

    same = tokenise_generation(tok, THREE_TURNS, turn, 4096)
    assert (same.id_check, same.source, same.result) == ("match", "template", ours)

    # The server tokenised its answer differently (e.g. another merge): its ids win, the prompt's
    # earlier assistant turns keep their mask, and the end-of-turn the server stopped on is added.
    other = completion[:-1] + [completion[-1] + 1]
    diff = tokenise_generation(tok, THREE_TURNS, {**turn, "completion_token_ids": other}, 4096)
    assert diff.id_check == "mismatch" and diff.source == "server"
    assert diff.mismatch == Mismatch(len(prompt) + len(completion) - 1, "completion", other[-1], completion[-1])
    assert diff.result.input_ids == prompt + other + [tok.eos_token_id]
    assert diff.result.loss_mask == ours.loss_mask[:len(prompt)] + [1] * (len(other) + 1)

    # No ids from the server: nothing to check; a cut answer's end-of-turn is not taught.
    none = tokenise_generation(tok, THREE_TURNS, {"finish_reason": "stop"}, 4096)
    assert none.id_check == "none" and none.result == ours
    cut = tokenise_generation(tok, THREE_TURNS, {"finish_reason": "length"}, 4096).result
    last = max(i for i, m in enumerate(ours.loss_mask) if m)
    assert ours.input_ids[last] == tok.eos_token_id
    assert cut.loss_mask == ours.loss_mask[:last] + [0] + ours.loss_mask[last + 1:]

    # Pre-tokenised imports are used as given, after a shape check; limits apply last.
    stored = tokenise_generation(tok, THREE_TURNS, None, 3, stored=([5, 6, 7, 8], [0, 1, 1, 1]))
    assert stored.result == Sample([5, 6, 7], [0, 1, 1], truncated_tokens=1, truncated_masked_tokens=1)
    bad = tokenise_generation(tok, THREE_TURNS, None, 10, stored=([5, 6], [0, 2]))
    assert isinstance(bad.result, Skipped) and "mask must be 0/1" in bad.result.reason


def test_earlier_assistant_turns_keep_their_mask_when_the_server_tokenised_them_differently(tok):
    """llama.cpp re-tokenises the history it is sent; where one earlier-turn token comes back split
    (or merged), that turn is still target-written and must stay in the sample, while a change in a
    user turn stays unmasked."""
    ours = render_and_mask(tok, THREE_TURNS, 4096)
    prompt = _template_ids(tok, prompt_messages(THREE_TURNS), True)
    first, second = _runs(ours.loss_mask, 1)[:2]
    # split one token in the middle of the first assistant turn into two (same text, other ids)
    k = (first[0] + first[1]) // 2
    text = tok.decode([prompt[k]])
    pieces = tok(text[:1], add_special_tokens=False)["input_ids"] + tok(text[1:], add_special_tokens=False)["input_ids"]
    assert len(text) > 1 and pieces != [prompt[k]]
    # and change one token of the user turn between the two assistant turns
    u = second[0] - 3
    assert ours.loss_mask[u] == 0
    server_prompt = prompt[:k] + pieces + prompt[k + 1:u] + [prompt[u] + 1] + prompt[u + 1:]
    completion = tok(THREE_TURNS[-1]["content"], add_special_tokens=False)["input_ids"]
    turn = {"prompt_token_ids": server_prompt, "completion_token_ids": completion, "finish_reason": "stop"}

    got = tokenise_generation(tok, THREE_TURNS, turn, 4096)
    assert got.id_check == "mismatch" and got.source == "server"
    assert got.mismatch.part == "prompt" and got.mismatch.position == k
    want_prompt = ours.loss_mask[:k] + [1] * len(pieces) + ours.loss_mask[k + 1:len(prompt)]
    assert got.result.input_ids == server_prompt + completion + [tok.eos_token_id]
    assert got.result.loss_mask == want_prompt + [1] * (len(completion) + 1)
    # every earlier assistant token (both turns, with their end-of-turn ids) is kept
    assert got.result.num_masked == ours.num_masked + len(pieces) - 1


def test_carry_mask_copies_where_ids_agree_and_never_across_a_turn_boundary():
    ids = [10, 11, 12, 13, 14, 15, 16]
    mask = [0, 0, 1, 1, 1, 0, 0]
    assert carry_mask(ids, mask, ids) == mask
    assert carry_mask(ids, mask, ids[:4]) == mask[:4]  # a prefix of our text
    # inside a turn: replaced or inserted ids are masked
    assert carry_mask(ids, mask, [10, 11, 12, 90, 91, 14, 15, 16]) == [0, 0, 1, 1, 1, 1, 0, 0]
    assert carry_mask(ids, mask, [10, 11, 12, 13, 92, 14, 15, 16]) == [0, 0, 1, 1, 1, 1, 0, 0]
    # a run that crosses the turn's end (ours: 14 masked, 15 not) stays 0; so does an insert at its edge
    assert carry_mask(ids, mask, [10, 11, 12, 13, 93, 16]) == [0, 0, 1, 1, 0, 0]
    assert carry_mask(ids, mask, [10, 11, 12, 13, 14, 94, 15, 16]) == [0, 0, 1, 1, 1, 0, 0, 0]
    # frequent ids still anchor the alignment (no junk heuristic): a long run of one id, one changed
    long_ids = [7] * 300 + [1, 2, 3]
    long_mask = [1] * 300 + [0, 0, 0]
    assert carry_mask(long_ids, long_mask, [7] * 150 + [8] + [7] * 149 + [1, 2, 3]) == long_mask
