"""The held-out chat set: which kept prompts are reserved for evaluation, and how they are benchmarked.

Owns the split (a salted hash of the prompt id against `discover.heldout.fraction`, up to
`discover.heldout.cap` prompts per workspace) and the benchmark domain `heldout_chat` made from
the held-out prompts. Promises: the same prompt id always gets the same split key, on any machine
and in any run; a held-out prompt is an outcome of its own (`heldout`, not `kept`), so records in
= kept + heldout + duplicates + contaminated + quarantined still reconciles, and nothing that
selects `kept` prompts (regenerate, training lineage) ever sees it.

Why training data cannot contain a held-out prompt (the decontamination against this set):
- A held-out prompt is stored in `prompts` and in the MinHash/LSH index exactly like a kept one,
  so every later record with the same canonical text is an `exact_duplicate` of it, and every
  later record at or above the near-dedupe Jaccard threshold is a `near_duplicate` of it: neither
  is kept, so neither is regenerated or trained on.
- Inside one batch, near-dedupe clusters first and only a cluster's root can be kept or held out;
  every other member names the root as its duplicate. So a held-out prompt's near twins in its
  own batch are duplicates too.
- A record decided *before* a prompt is held out cannot be its duplicate either: the later text
  would then be the duplicate (of the earlier kept prompt), never held out.
- regenerate asks only for prompts not held out (`store.generations.pending_prompts`), and imported
  conversations that are exact duplicates of a held-out prompt get no generation.
What this does not catch: a training prompt that quotes part of a held-out prompt below the
near-dedupe threshold (an n-gram overlap, not a duplicate). HumanEval and named eval sets get the
n-gram check (tasks.discover.decontaminate); held-out chat prompts are ordinary chat and share common
phrases with many others, so an n-gram rule would drop training data for no measurable gain.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

HELDOUT_DOMAIN = "heldout_chat"
_SALT = b"eagle3-heldout-v1\x00"


def split_key(prompt_id: str) -> float:
    """A number in [0, 1) fixed by the prompt id alone (salted SHA-256; no Python `hash`)."""
    digest = hashlib.sha256(_SALT + prompt_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def choose_heldout(prompt_ids: Sequence[str], fraction: float, room: int) -> list[str]:
    """The prompt ids (of new kept prompts) to hold out: key below `fraction`, smallest keys first, at most `room`.

    Smallest keys first makes the choice independent of the order prompts come in within a batch.
    """
    if fraction <= 0 or room <= 0:
        return []
    below = sorted((k, p) for p in set(prompt_ids) if (k := split_key(p)) < fraction)
    return [p for _, p in below[:room]]


def chat_opening(messages: Sequence[Mapping[str, Any]]) -> list[dict]:
    """A held-out conversation as a benchmark request: its messages up to its first user turn.

    Later turns would put human-written assistant text (not the target's) into the context.
    """
    out = []
    for m in messages:
        out.append({"role": m["role"], "content": m["content"]})
        if m["role"] == "user":
            return out
    raise ValueError("a held-out prompt has no user turn")


def heldout_set(prompts: Sequence[tuple[str, Sequence[Mapping[str, Any]]]]) -> tuple[str, list[list[dict]]] | None:
    """(domain, requests) for the benchmark from held-out (prompt id, messages), in the order given; None if none."""
    if not prompts:
        return None
    return HELDOUT_DOMAIN, [chat_opening(m) for _, m in prompts]
