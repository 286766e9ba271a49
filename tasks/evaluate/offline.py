"""Offline acceptance measurement: greedy speculative decoding with the target and a drafter in torch, no server.

The benchmark stage's offline half and the one import for its callers: `offline_acceptance` (the
draft and the baselines on the benchmark sets), `evaluate_acceptance` (any prompts, any drafters)
and `load_draft_for_target`, over four parts that each keep their own promises:
- tasks/evaluate/prompt_sets.py: HumanEval and jsonl sets, always chat-templated with the
  generation prompt (docs/contracts.md, silent failure 10);
- tasks/evaluate/drafters.py: the `Drafter` protocol, the EAGLE-3 draft's serving recurrence,
  prompt lookup, the oracle;
- tasks/evaluate/decoding.py: the target's greedy decoding, chain speculation verified against it
  (lossless by construction, and checked), counted as SGLang counts;
- tasks/evaluate/report.py: `AcceptanceReport`, token-weighted and per-request-mean acceptance.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.evaluate.decoding import (FinishReason, GreedyPath, LossyDecoding, RequestResult, check_lossless,
                                     first_difference, greedy_path, speculative_generate, target_greedy)
from tasks.evaluate.drafters import (Drafter, Eagle3Drafter, OracleDrafter, PromptLookupDrafter, TargetState,
                                     draft_chain_logits, standard_drafters)
from tasks.evaluate.prompt_sets import (HUMANEVAL, HUMANEVAL_INSTRUCTION, BenchPrompt, PromptInput, benchmark_sets,
                                        humaneval_prompts, load_prompt_file, prompts_for_benchmark)
from tasks.evaluate.report import AcceptanceReport, Aggregate, aggregate

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from tasks.model.draft import Eagle3Draft

__all__ = [
    "HUMANEVAL", "HUMANEVAL_INSTRUCTION", "AcceptanceReport", "Aggregate", "BenchPrompt", "Drafter", "Eagle3Drafter",
    "FinishReason", "GreedyPath", "LossyDecoding", "OracleDrafter", "PromptInput", "PromptLookupDrafter",
    "RequestResult", "TargetState", "aggregate", "benchmark_sets", "check_lossless", "draft_chain_logits",
    "evaluate_acceptance", "first_difference", "greedy_path", "humaneval_prompts", "load_draft_for_target",
    "load_prompt_file", "offline_acceptance", "prompts_for_benchmark", "speculative_generate", "standard_drafters",
    "target_greedy",
]


def evaluate_acceptance(target: PreTrainedModel, prompts: Sequence[BenchPrompt], drafters: Sequence[Drafter], k: int,
                        max_new_tokens: int, stop_ids: set[int] | frozenset[int] = frozenset(), *,
                        recompute: bool = False, paths: dict[str, GreedyPath] | None = None,
                        reference: Mapping[str, Sequence[int]] | None = None) -> AcceptanceReport:
    """Decode every prompt with every drafter (greedy, depth k) and report acceptance.

    One plain greedy decoding per prompt serves every drafter; pass a dict as `paths` to keep them
    (item id -> GreedyPath) for another k. Every output is checked equal to that decoding, and to
    `reference` (item id -> ids decoded elsewhere) when given: LossyDecoding otherwise.
    """
    names = [d.name for d in drafters]
    if len(set(names)) != len(names):
        raise ValueError(f"drafter names must be distinct, got {names}")
    per_prompt: list[list[RequestResult]] = []
    greedy: dict[str, list[int]] = {}
    for p in prompts:
        path = paths.get(p.item_id) if paths is not None else None
        if path is None:
            path = greedy_path(target, p.input_ids, max_new_tokens, stop_ids, recompute=recompute)
            if paths is not None:
                paths[p.item_id] = path
        greedy[p.item_id] = path.new_ids
        per_prompt.append([speculative_generate(target, p.input_ids, d, k, max_new_tokens, stop_ids, domain=p.domain,
                                                item_id=p.item_id, path=path) for d in drafters])
    results = [row[i] for i in range(len(drafters)) for row in per_prompt]  # drafter by drafter
    checked = check_lossless(results, greedy)
    if reference is not None:
        check_lossless(results, reference)
    return AcceptanceReport.build(k, max_new_tokens, results, checked)


def load_draft_for_target(folder: str | Path, target: PreTrainedModel) -> Eagle3Draft:
    """An exported draft folder (SGLang or speculators format) with the target's embeddings, on its device.

    The contract check runs first (tasks.export.checkpoint: a failing folder raises CheckpointError), so a
    draft the server would run wrong is never benchmarked.
    """
    from tasks.export.checkpoint import load_draft

    text = target.config.get_text_config()
    draft = load_draft(folder, embed_tokens=target.get_input_embeddings().weight.detach(),
                       target_num_layers=text.num_hidden_layers)
    if draft.config.target_vocab_size != text.vocab_size or draft.config.hidden_size != text.hidden_size:
        raise ValueError(f"{folder}: the draft was built for vocab {draft.config.target_vocab_size}, hidden "
                         f"{draft.config.hidden_size}; the target has {text.vocab_size}, {text.hidden_size}")
    return draft.to(target.device).eval()


def offline_acceptance(target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, draft: Eagle3Draft, *,
                       chat_template: str | None = None,
                       sets: Sequence[tuple[str, Sequence[PromptInput]]] | None = None,
                       limit: int | None = 20, k: int = 4, max_new_tokens: int = 128,
                       baselines: bool = True) -> AcceptanceReport:
    """The benchmark stage without a server: `draft` and the baselines on HumanEval (or `sets`).

    On a CPU the draft computes in float32 (converted in place): CPUs without native bf16 run its
    bf16 matmuls about 4x slower (35 vs 140 ms a proposal here), and bf16 weights are exact in float32.
    """
    from tasks.model.target import stop_token_ids

    if draft.config.target_vocab_size != target.config.get_text_config().vocab_size:
        raise ValueError(f"the draft was built for a {draft.config.target_vocab_size}-token vocab, the target has "
                         f"{target.config.get_text_config().vocab_size}")
    if draft.fc.weight.device.type == "cpu":
        draft = draft.float()
    prompts = prompts_for_benchmark(tokenizer, chat_template, sets if sets is not None else benchmark_sets(), limit)
    return evaluate_acceptance(target, prompts, standard_drafters(draft, baselines), k, max_new_tokens,
                               stop_token_ids(target, tokenizer))
