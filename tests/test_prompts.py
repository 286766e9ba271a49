"""Record formats, role mapping and the definition of a prompt."""

from __future__ import annotations

import hashlib
import json
import unicodedata

import pytest

from tasks.discover.prompts import Prompt, Quarantine, canonical_text, normalise_record, prompt_id_of


def sg(*turns):
    return {"conversations": [{"from": r, "value": v} for r, v in turns]}


def test_sharegpt_roles_map_and_trailing_answer_is_dropped():
    p = normalise_record(sg(("system", "Be brief."), ("human", "Hi"), ("chatgpt", "Hello"), ("user", "Bye?"), ("bard", "Bye")))
    assert isinstance(p, Prompt) and p.format == "sharegpt"
    assert [m["role"] for m in p.messages] == ["system", "user", "assistant", "user"]
    assert p.text == "Be brief.\n\nHi\n\nBye?"


def test_openai_messages_with_text_parts():
    p = normalise_record({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert p.messages == [{"role": "user", "content": "ab"}]
    q = normalise_record({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})
    assert isinstance(q, Quarantine) and "non-text content" in q.reason


def test_alpaca_instruction_and_input():
    p = normalise_record({"instruction": "Translate", "input": "chat", "output": "cat"})
    assert p.format == "alpaca" and p.messages == [{"role": "user", "content": "Translate\n\nchat"}]
    assert normalise_record({"instruction": "Say hi", "input": "", "output": "hi"}).messages[0]["content"] == "Say hi"


def test_prompt_response_columns_configurable():
    p = normalise_record({"q": "why?", "a": "because"}, "prompt_response", "q", "a")
    assert p.messages == [{"role": "user", "content": "why?"}]
    assert isinstance(normalise_record({"q": "why?"}, "prompt_response", "question", "a"), Quarantine)


@pytest.mark.parametrize(
    "record, reason",
    [
        (sg(("human", "hi"), ("wizard", "x")), "turn 1: unknown role 'wizard'"),
        (sg(("gpt", "hello"), ("gpt", "anyone?")), "no user turn"),
        (sg(("human", "  \n ")), "turn 0 (user): empty content"),
        (sg(("human", "hi"), ("gpt", "yo"), ("system", "late")), "turn 2: system turn after the conversation started"),
        ({"conversations": [{"from": "human"}]}, "format sharegpt: turn 0: expected an object with 'from' and 'value'"),
        ({"conversations": "nope"}, "unknown format"),
        ({"messages": [{"role": "user", "content": 5}]}, "turn 0 (user): content is int, not text"),
        ({"title": "x"}, "unknown format: no 'conversations', 'messages', 'instruction' or 'prompt' field (fields: title)"),
        (None, "unreadable record"),
    ],
)
def test_bad_records_are_quarantined_with_a_reason(record, reason):
    q = normalise_record(record)
    assert isinstance(q, Quarantine)
    assert q.reason.startswith(reason)


def test_leading_assistant_turns_are_dropped_and_counted():
    p = normalise_record(sg(("gpt", "Hi! How can I help?"), ("human", "Tell me a joke"), ("gpt", "...")))
    assert p.messages == [{"role": "user", "content": "Tell me a joke"}]
    assert p.dropped_leading_assistant == 1


def test_consecutive_turns_of_one_role_are_joined():
    p = normalise_record(sg(("human", "part one"), ("human", "part two"), ("gpt", "a"), ("gpt", "b"), ("human", "more")))
    assert [m["content"] for m in p.messages] == ["part one\n\npart two", "a\n\nb", "more"]


def test_prompt_id_ignores_case_whitespace_unicode_form_and_assistant_turns():
    a = normalise_record(sg(("human", "Hello   World\r\nCafé"), ("gpt", "x"), ("human", "next")))
    b = normalise_record(sg(("human", "hello world cafe\u0301"), ("gpt", "something else"), ("human", "NEXT")))
    c = normalise_record(sg(("human", "hello world café!"), ("gpt", "x"), ("human", "next")))
    assert a.prompt_id == b.prompt_id != c.prompt_id
    assert canonical_text("  A\u00a0b\tC ") == "a b c"


# Texts at the edges of canonical_text's and prompt_id_of's shortcuts for single-spaced, printable text.
EDGE_TEXTS = [
    "plain words only", "Mixed CASE Words", "two  spaces", " leading", "trailing ", "tab\there", "new\nline",
    "crlf\r\nend", "vt\x0bff\x0c", "seps\x1c\x1d\x1e\x1fend", "bell\x07inside", "del\x7finside",
    'a "quoted" word', "back\\slash", "nul\x00byte", "café au lait", "ﬁne ligature", "Straße",
    "nbsp\u00a0here", "line\u2028sep", "\u3000ideographic space", "emoji 🙂 ok", "x",
]


def reference_canonical(text: str) -> str:
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


@pytest.mark.parametrize("text", EDGE_TEXTS)
def test_canonical_text_and_prompt_id_agree_with_their_definitions(text):
    assert canonical_text(text) == reference_canonical(text)
    messages = [{"role": "system", "content": "Be \"brief\"."}, {"role": "user", "content": text},
                {"role": "assistant", "content": "ignored"}, {"role": "user", "content": text + " again"}]
    parts = [[m["role"], reference_canonical(m["content"])] for m in messages if m["role"] != "assistant"]
    expected = hashlib.sha256(json.dumps(parts, ensure_ascii=False, separators=(",", ":")).encode()).hexdigest()[:32]
    assert prompt_id_of(messages) == expected


def test_roles_are_matched_as_written_or_after_trimming_and_lower_casing():
    assert normalise_record(sg((" Human ", "hi"), ("GPT", "a"), ("user", "more"))).messages == [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "more"}]
    bad = normalise_record({"conversations": [{"from": 7, "value": "hi"}]})
    assert bad == Quarantine("turn 0: unknown role 7")
