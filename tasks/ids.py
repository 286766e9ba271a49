"""Content ids: the name of every piece of work is a hash of what it was made from.

Owns the recipe of each id the pipeline resumes on. Resume is by content, never by count: a stage
that finds the id of the work it is about to do already recorded in lineage skips it, so a crash,
a rerun or a second machine redoes nothing that exists, and a changed input (another target,
template, sampling, vocab, setting) gets a new id and so new work, never a silent mix.
Promise: each recipe below is byte-for-byte what existing workspaces were written with; changing
one orphans every row and file named with it (a new recipe means a new name, not an edit).

- prompt id (32 hex): sha256 of the compact JSON list `[[role, canonical_text(content)], ...]` of the
  system and user turns (assistant turns are what regenerate replaces, so two records asking the
  same things are the same prompt); `canonical_text` is NFKC, case-folded, whitespace collapsed.
- template id: "sha256:" + 16 hex of the chat template's text (a new template renders other tokens).
- generation params key (16 hex): sha256 of the sorted JSON of target model, revision, template id,
  mode, reasoning handling and sampling parameters: how generations are made.
- generation id (32 hex): sha256 of `prompt_id NUL params_key`: one answer per prompt and recipe.
- tokenize key (16 hex): target, revision, template id, max_length, overflow and the generation
  params keys read: one tokenisation of the generations, the draft vocab is counted from it.
- vocab id: the first 16 hex of the vocab file's sha256 (a given file keeps its id everywhere).
- extract key (16 hex): tokenize key, vocab id, aux layers, teacher (topk only when it is topk),
  storage and shard file format: what a shard's tensors mean.
- sample id (32 hex): sha256 of `generation_id NUL extract_key`: one sample per generation and key.
- config hash (16 hex): sha256 of a config's compact sorted JSON: the config each lineage row ran under.
"""

from __future__ import annotations

import hashlib
import json
import unicodedata
from json.encoder import encode_basestring as _json_str
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import BaseModel

    from tasks.config import RegenerateConfig
    from tasks.extract.hf_backend import ExtractSettings


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _key(payload: dict) -> str:
    return _sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")))[:16]


# ---------------------------------------------------------------- discover: prompts


def canonical_text(text: str) -> str:
    """The exact-dedupe form: NFKC, case-folded, whitespace runs collapsed to one space."""
    if text.isascii():  # NFKC leaves ASCII as it is and casefold is lower() there: the same text, 2x faster
        if _single_spaced_ascii(text):  # nothing to collapse: split and join would rebuild the same text
            return text.lower()
        return " ".join(text.lower().split())
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def _single_spaced_ascii(text: str) -> bool:
    """An ASCII text whose only whitespace is single spaces between words. Every other ASCII
    whitespace character (tab, newline, \\x0b-\\x0d, \\x1c-\\x1f) is a control character, which
    `isprintable` refuses."""
    return text.isprintable() and "  " not in text and text[:1] != " " and text[-1:] != " "


def prompt_id_of(messages: list[dict]) -> str:
    # The bytes json.dumps(parts, ensure_ascii=False, separators=(",", ":")) gives, built from
    # its C string encoder directly: json.dumps makes a new encoder per call, a third of
    # discover's per-record cost at 10M records.
    parts = ",".join(f"[{_json_str(m['role'])},{_json_text(canonical_text(m['content']))}]"
                     for m in messages if m["role"] != "assistant")
    return _sha256(f"[{parts}]")[:32]


def _json_text(text: str) -> str:
    """`encode_basestring(text)`: it escapes only quotes, backslashes and control characters, so
    a printable text without the first two is itself in quotes, without a scan in Python's JSON."""
    if text.isprintable() and '"' not in text and "\\" not in text:
        return f'"{text}"'
    return _json_str(text)


# ---------------------------------------------------------------- regenerate: generations


def template_id(chat_template: str) -> str:
    return "sha256:" + _sha256(chat_template)[:16]


def generation_params_key(cfg: RegenerateConfig, template_id: str) -> str:
    blob = json.dumps(
        {
            "target": cfg.target_model,
            "revision": cfg.target_revision,
            "template": template_id,
            "mode": cfg.mode,
            "reasoning": cfg.reasoning,
            "sampling": cfg.sampling.model_dump(mode="json"),
        },
        sort_keys=True,
    )
    return _sha256(blob)[:16]


def generation_id(prompt_id: str, params_key: str) -> str:
    return _sha256(f"{prompt_id}\x00{params_key}")[:32]


# ---------------------------------------------------------------- extract: tokenisation, vocab, shards


def tokenize_key(target_name: str, target_revision: str, template_id: str, max_length: int, overflow: str,
                 generation_params_keys: list[str] | None) -> str:
    """Names one tokenisation of the generations: its draft vocab is counted from exactly these samples."""
    return _key({"target": target_name, "revision": target_revision, "template": template_id,
                 "max_length": max_length, "overflow": overflow,
                 "generations": sorted(generation_params_keys) if generation_params_keys is not None else None})


def vocab_id(file_sha256: str) -> str:
    return file_sha256[:16]


def extract_key(tokenize: str, vocab_id: str, settings: ExtractSettings) -> str:
    """Names what a shard's tensors mean: tokenisation, vocab, layers, teacher, storage, file format."""
    # Imported here: this module stays free of torch for the stages that never extract.
    from tasks.extract.hf_backend import SHARD_FORMAT

    return _key({"tokenize": tokenize, "vocab": vocab_id, "aux_layer_ids": settings.aux_layer_ids,
                 "teacher": settings.teacher, "topk": settings.topk if settings.teacher == "topk" else None,
                 "storage": settings.storage, "format": SHARD_FORMAT})


def sample_id(generation_id: str, extract: str) -> str:
    return _sha256(f"{generation_id}\x00{extract}")[:32]


# ---------------------------------------------------------------- every stage: lineage rows


def config_hash(model: BaseModel) -> str:
    """A stable hash of a config's content (every lineage row records the config it ran under)."""
    canonical = json.dumps(model.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return _sha256(canonical)[:16]
