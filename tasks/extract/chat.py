"""Tokenisation stage of extraction: render a conversation with the target's own chat template and mask its assistant turns.

Owns turning a conversation (role, content, optional reasoning_content) into `input_ids` and a 0/1
`loss_mask`, and checking those ids against the ids a server reported. Promises: the text is the
template's own rendering (its default system prompt kept, as llama.cpp's server keeps it), so the
prompt part tokenises to exactly `apply_chat_template(prompt, add_generation_prompt=True)`; the mask
covers each assistant turn's tokens plus its end-of-turn token and nothing else; a conversation
that cannot be rendered and masked faithfully (reasoning the template would drop, special-token
strings in assistant text, a token straddling a turn boundary, a template whose renders are not
prefixes of one another) comes back as `Skipped(reason)`, never as a silently wrong sample
(docs/contracts.md, silent failure 7).

Masking method: char spans from prefix renders, mapped to tokens by offsets. For assistant turn
i, `len(render(messages[:i], add_generation_prompt=True))` is where its content starts (just after
the role header) and `len(render(messages[:i+1]))` where its rendered turn ends; the full text is
tokenised once with `return_offsets_mapping=True` and a token is masked when it starts inside the
span, up to and including the last end-of-turn id there (the template's trailing "\n" after
`<|im_end|>` is never generated, so it stays unmasked). Why: the template itself says where a turn
begins and ends, so no regex over decoded text has to guess it, user text that contains
"<|im_end|>" cannot move a boundary, and the text is tokenised once, exactly as a server tokenises
a whole rendered prompt.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Overflow = Literal["truncate", "drop"]
REASONING_KEYS = ("reasoning_content", "thinking")


@dataclass(frozen=True)
class Sample:
    """One tokenised conversation; `truncated_tokens` counts tokens cut off the end (0 if none)."""

    input_ids: list[int]
    loss_mask: list[int]
    truncated_tokens: int = 0
    truncated_masked_tokens: int = 0  # assistant tokens among the cut ones: training signal lost

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_masked(self) -> int:
        return sum(self.loss_mask)


@dataclass(frozen=True)
class Skipped:
    """A conversation that yields no sample, and why (one readable line)."""

    reason: str
    num_tokens: int | None = None  # the rendered length, where rendering got that far


@dataclass(frozen=True)
class Mismatch:
    """The first position where our ids differ from a server's (None: that side had no token there)."""

    position: int
    part: Literal["prompt", "completion"]
    server_id: int | None
    our_id: int | None


@dataclass(frozen=True)
class MismatchReport:
    checked: int
    mismatched: int
    first: tuple[int, Mismatch] | None = None  # (index in the input, its mismatch)
    mismatches: list[tuple[int, Mismatch]] = field(default_factory=list, repr=False)

    @property
    def rate(self) -> float:
        return self.mismatched / self.checked if self.checked else 0.0


def template_supports_reasoning(tokenizer: PreTrainedTokenizerBase, chat_template: str | None = None) -> bool:
    """Whether the chat template reads a reasoning field of a message at all."""
    template = _template_text(tokenizer, chat_template)
    return any(key in template for key in REASONING_KEYS)


def render_and_mask(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, Any]], max_length: int,
                    overflow: Overflow = "truncate", *, chat_template: str | None = None,
                    end_of_turn_ids: Iterable[int] | None = None) -> Sample | Skipped:
    """Render `messages` with the tokenizer's template (or `chat_template`, e.g. the GGUF's) and mask the assistant turns.

    `end_of_turn_ids` defaults to the tokenizer's eos (`<|im_end|>` for ChatML). Over `max_length`,
    "truncate" cuts the end and counts what it cut; "drop" returns Skipped. A sample with no masked
    token left is Skipped: it carries no training signal.
    """
    if overflow not in ("truncate", "drop"):
        raise ValueError(f"overflow must be 'truncate' or 'drop', not {overflow!r}")
    if max_length <= 0:
        raise ValueError(f"max_length must be positive, not {max_length}")
    messages = [dict(m) for m in messages]
    assistant_turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if not assistant_turns:
        return Skipped("no assistant turn")
    if assistant_turns[0] == 0:
        # No prompt precedes it: no server generated it, and the template cannot render an empty head.
        return Skipped("the conversation starts with an assistant turn")
    eot = set(end_of_turn_ids) if end_of_turn_ids is not None else {tokenizer.eos_token_id}
    eot.discard(None)
    if not eot:
        raise ValueError("the tokenizer has no eos token; pass end_of_turn_ids")

    supports_reasoning = template_supports_reasoning(tokenizer, chat_template)
    for i in assistant_turns:
        if not supports_reasoning and any(messages[i].get(k) for k in REASONING_KEYS):
            # The template would drop it without a word, and the draft would learn answers
            # without the thinking the target produced before them (silent failure 7).
            return Skipped(f"assistant turn {i} has reasoning, but the chat template renders no {'/'.join(REASONING_KEYS)}")
        # Assistant text that spells a special token re-tokenises to that special id, which the
        # model never generates inside a turn (the server stops at `<|im_end|>`): training on it
        # would teach a sequence serving never shows, and would put a second end-of-turn in the mask.
        hit = _special_string_in(tokenizer, messages[i])
        if hit is not None:
            return Skipped(f"assistant turn {i} contains the special-token string {hit!r}")

    def render(msgs: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             chat_template=chat_template)

    text = render(messages, False)
    spans: list[tuple[int, int]] = []
    for i in assistant_turns:
        head = render(messages[:i], True)
        turn = render(messages[:i + 1], False)
        # The method rests on each render being a prefix of the full one; templates that rewrite
        # history (e.g. dropping earlier turns' reasoning) break it, and we say so.
        if not (text.startswith(head) and text.startswith(turn) and turn.startswith(head)):
            return Skipped(f"the chat template's render up to assistant turn {i} is not a prefix of the full render")
        spans.append((len(head), len(turn)))

    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = list(enc["input_ids"])
    offsets: list[tuple[int, int]] = [tuple(o) for o in enc["offset_mapping"]]
    mask = [0] * len(ids)
    for turn_no, (start, end) in zip(assistant_turns, spans, strict=True):
        in_turn = [t for t, (a, b) in enumerate(offsets) if start <= a < end]
        straddle = [t for t, (a, b) in enumerate(offsets) if (a < start < b) or (a < end < b)]
        if straddle:
            # A token merged across the header/content (or turn end) boundary: the server
            # tokenises the prompt up to the header alone, so it would never see this token.
            return Skipped(f"a token straddles the boundary of assistant turn {turn_no}", len(ids))
        ends = [t for t in in_turn if ids[t] in eot]
        if not ends:
            return Skipped(f"assistant turn {turn_no} has no end-of-turn token", len(ids))
        for t in in_turn:
            if t > ends[-1]:
                break
            mask[t] = 1

    return fit_length(Sample(ids, mask), max_length, overflow)


def fit_length(sample: Sample, max_length: int, overflow: Overflow) -> Sample | Skipped:
    """`sample` cut to `max_length` tokens ("truncate", counted) or Skipped ("drop"); Skipped if no masked token is left."""
    ids, mask = sample.input_ids, sample.loss_mask
    if not any(mask):
        return Skipped("no assistant token to learn from", len(ids))
    if len(ids) <= max_length:
        return sample
    if overflow == "drop":
        return Skipped(f"{len(ids)} tokens > max_length {max_length}", len(ids))
    cut_masked = sum(mask[max_length:])
    cut = len(ids) - max_length
    ids, mask = ids[:max_length], mask[:max_length]
    if not any(mask):
        return Skipped(f"no assistant token within max_length {max_length} ({cut + max_length} tokens)", cut + max_length)
    return Sample(ids, mask, truncated_tokens=cut, truncated_masked_tokens=cut_masked)


def prompt_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The messages before the last assistant turn: what a server was sent to generate that turn."""
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
    if last is None:
        raise ValueError("no assistant turn")
    return [dict(m) for m in messages[:last]]


def check_against_server_ids(sample: Sample, prompt_token_ids: Sequence[int],
                             completion_token_ids: Sequence[int]) -> Mismatch | None:
    """Whether `sample` starts with the server's prompt ids then its completion ids; the first difference if not.

    The sample must be the conversation whose last assistant turn is that completion. A server's
    completion may or may not end with the end-of-turn id (llama.cpp leaves it out), so only the
    ids it returned are compared. A truncated sample that ends early is a mismatch (our_id None).
    """
    server = list(prompt_token_ids) + list(completion_token_ids)
    for pos, server_id in enumerate(server):
        our_id = sample.input_ids[pos] if pos < len(sample.input_ids) else None
        if our_id != server_id:
            part = "prompt" if pos < len(prompt_token_ids) else "completion"
            return Mismatch(pos, part, server_id, our_id)
    return None


def carry_mask(our_ids: Sequence[int], our_mask: Sequence[int], server_ids: Sequence[int]) -> list[int]:
    """Our loss mask carried onto the server's tokenisation of the same text (`server_ids` may be a prefix of it).

    The two sequences are aligned (difflib, no junk heuristic, so frequent ids like "\n" still
    anchor): where the ids agree the mask is copied; a run tokenised differently on the two sides
    (llama.cpp merging "\n\n" where the template's tokenizer does not, say) is masked only when
    our side of it lies wholly inside a masked turn, and a server run with no counterpart only when
    both our neighbours are masked. Anything crossing a turn boundary stays 0: losing a few tokens
    of signal is cheap, teaching a user's or header token as target output is not.
    Why it matters: a multi-turn sample's earlier assistant turns are target-written too; an
    all-or-nothing rule zeroed all of them on any difference (about a third of the tokens).
    """
    from difflib import SequenceMatcher

    our_ids, our_mask, server_ids = list(our_ids), list(our_mask), list(server_ids)
    mask = [0] * len(server_ids)
    for tag, i1, i2, j1, j2 in SequenceMatcher(None, our_ids, server_ids, autojunk=False).get_opcodes():
        if tag == "equal":
            mask[j1:j2] = our_mask[i1:i2]
        elif tag == "replace" and all(our_mask[i1:i2]):
            mask[j1:j2] = [1] * (j2 - j1)
        elif tag == "insert" and 0 < i1 < len(our_mask) and our_mask[i1 - 1] and our_mask[i1]:
            mask[j1:j2] = [1] * (j2 - j1)
    return mask


def mismatch_report(checks: Iterable[tuple[Sample, Sequence[int], Sequence[int]]]) -> MismatchReport:
    """Check (sample, prompt ids, completion ids) triples; the mismatch rate and the first mismatching one."""
    checked = 0
    found: list[tuple[int, Mismatch]] = []
    for index, (sample, prompt_ids, completion_ids) in enumerate(checks):
        checked += 1
        mismatch = check_against_server_ids(sample, prompt_ids, completion_ids)
        if mismatch is not None:
            found.append((index, mismatch))
    return MismatchReport(checked, len(found), found[0] if found else None, found)


def _template_text(tokenizer: PreTrainedTokenizerBase, chat_template: str | None) -> str:
    template = chat_template if chat_template is not None else tokenizer.chat_template
    if isinstance(template, dict):  # named templates: the default one renders chats
        template = template.get("default", "")
    if not template:
        raise ValueError("the tokenizer has no chat template; a server would guess one, and training would not match it")
    return template


def _special_string_in(tokenizer: PreTrainedTokenizerBase, message: Mapping[str, Any]) -> str | None:
    """The first special-token string (added tokens, e.g. `<|im_end|>`) in the message's text fields, if any."""
    specials = [s for s in tokenizer.all_special_tokens if s]
    specials += [t.content for t in tokenizer.added_tokens_decoder.values() if t.special and t.content not in specials]
    for key in ("content", *REASONING_KEYS):
        value = message.get(key)
        if isinstance(value, str):
            for s in specials:
                if s in value:
                    return s
    return None


IdCheck = Literal["match", "mismatch", "none"]


@dataclass(frozen=True)
class Tokenised:
    """A generation's sample (or why there is none) and how its ids compared with the server's."""

    result: Sample | Skipped
    id_check: IdCheck = "none"  # "none": the server returned no token ids to compare with
    mismatch: Mismatch | None = None
    source: Literal["template", "server", "stored"] = "template"  # where the sample's ids come from


def tokenise_generation(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, Any]],
                        last_turn: Mapping[str, Any] | None, max_length: int, overflow: Overflow = "truncate", *,
                        stored: tuple[Sequence[int], Sequence[int]] | None = None, chat_template: str | None = None,
                        end_of_turn_ids: Iterable[int] | None = None) -> Tokenised:
    """One generation as a training sample.

    `last_turn` is the record of the request that wrote the final assistant turn; where it holds
    the server's `prompt_token_ids` and `completion_token_ids`, our rendering is checked against
    them and, if they differ, the sample is built from the server's ids (what the target actually
    saw and produced), with the mask of our rendering carried onto the prompt part by
    `carry_mask` (the earlier assistant turns, also target-written, stay in the sample). `stored` is a pre-tokenised (input_ids, loss_mask) pair from an import: used as given
    after a shape check. Length limits apply last, so the id check sees the whole conversation.
    """
    if stored is not None:
        ids, mask = list(stored[0]), list(stored[1])
        if len(ids) != len(mask) or not ids or any(m not in (0, 1) for m in mask):
            return Tokenised(Skipped(f"stored input_ids/loss_mask unusable: {len(ids)} ids, {len(mask)} mask entries, "
                                     "mask must be 0/1"), source="stored")
        return Tokenised(fit_length(Sample(ids, mask), max_length, overflow), source="stored")
    full = render_and_mask(tokenizer, messages, 1 << 30, "truncate", chat_template=chat_template,
                           end_of_turn_ids=end_of_turn_ids)
    if isinstance(full, Sample) and (last_turn or {}).get("finish_reason") == "length":
        # The server cut the answer at max_tokens, so the template's end-of-turn after it was
        # never generated: do not teach the draft to predict it there.
        eot_ids = set(end_of_turn_ids) if end_of_turn_ids is not None else {tokenizer.eos_token_id}
        last = max(i for i, m in enumerate(full.loss_mask) if m)
        if full.input_ids[last] in eot_ids:
            full = Sample(full.input_ids, full.loss_mask[:last] + [0] + full.loss_mask[last + 1:])
    prompt_ids = (last_turn or {}).get("prompt_token_ids")
    completion_ids = (last_turn or {}).get("completion_token_ids")
    if isinstance(full, Skipped) or not prompt_ids or completion_ids is None:
        return Tokenised(full if isinstance(full, Skipped) else fit_length(full, max_length, overflow))
    mismatch = check_against_server_ids(full, prompt_ids, completion_ids)
    if mismatch is None:
        return Tokenised(fit_length(full, max_length, overflow), "match")
    eot = set(end_of_turn_ids) if end_of_turn_ids is not None else {tokenizer.eos_token_id}
    ids = list(prompt_ids) + list(completion_ids)
    if last_turn.get("finish_reason") == "stop" and (not completion_ids or completion_ids[-1] not in eot):
        ids.append(tokenizer.eos_token_id)  # the server stopped on it without returning it (llama.cpp does)
    n = len(prompt_ids)
    # Aligned against our prompt part only (up to the last turn's first masked token), so no server
    # prompt token can pair with a token of the answer it was generating.
    start = max(i for i, m in enumerate(full.loss_mask) if m)
    while start and full.loss_mask[start - 1]:
        start -= 1
    prompt_mask = carry_mask(full.input_ids[:start], full.loss_mask[:start], prompt_ids)
    sample = Sample(ids, prompt_mask + [1] * (len(ids) - n))
    return Tokenised(fit_length(sample, max_length, overflow), "mismatch", mismatch, "server")


def tokenise_rows(tokenizer: PreTrainedTokenizerBase, rows: Iterable[Mapping[str, Any]], max_length: int,
                  overflow: Overflow, chat_template: str | None = None) -> list[Tokenised]:
    """`tokenise_generation` over stored generation rows (messages, turns, optional input_ids/loss_mask)."""
    out = []
    for row in rows:
        stored = (row["input_ids"], row["loss_mask"]) if row.get("input_ids") else None
        last_turn = row["turns"][-1] if row.get("turns") else None
        out.append(tokenise_generation(tokenizer, row["messages"], last_turn, max_length, overflow, stored=stored,
                                       chat_template=chat_template))
    return out
