"""The draft vocab of a tokenisation: built once from this workspace's generations (or given as a file), then reused.

Owns how an extract run reads and tokenises the workspace's generations (`StageContext`: the
target's tokenizer and serving template, max_length and overflow) and the draft vocab each
tokenisation is trained for. Promises: the vocab is built once per tokenisation (tokenize key and
size) from every generation's loss-masked tokens, or copied byte for byte from `draft_vocab_file`,
registered in lineage with its coverage report, and afterwards loaded with its checksum verified,
so that later rounds keep the same draft ids; a vocab file changed after it was built is refused.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from storage.datasets import file_sha256, read_generation_rows, write_bytes_atomic
from storage.lineage import LineageError, LineageStore
from tasks.config import ExtractConfig
from tasks.extract.chat import Sample, Tokenised, tokenise_rows
from tasks.extract.vocab import (DraftVocab, TokenCounter, build_draft_vocab, coverage_report, load_vocab, save_vocab,
                                 split_half_coverage, thin_vocab_warning)
from tasks.ids import vocab_id
from tasks.model.target import TargetIdentity

READ_CHUNK = 256  # generations read and tokenised at a time


@dataclass
class StageContext:
    """What every step of a run shares: where things are, what the target is, how samples are made."""

    config: ExtractConfig
    store: LineageStore
    workspace: Path
    tokenizer: object
    identity: TargetIdentity
    tokenize_key: str

    @property
    def generations_dir(self) -> Path:
        return self.workspace / "data" / "generations"

    def tokenise(self, items: list[tuple[str, str, str]]) -> list[Tokenised]:
        """Samples of (generation_id, params_key, file) items, in order."""
        rows = read_generation_rows(self.generations_dir, [(g, f"{p}/{f}") for g, p, f in items])
        return tokenise_rows(self.tokenizer, rows, self.config.max_length, self.config.overflow,
                             self.identity.chat_template)


def draft_vocab_for(ctx: StageContext, run_id: str, logger) -> tuple[DraftVocab, str, dict]:
    """The vocab of this tokenisation: the given file's (`draft_vocab_file`), else built from every
    generation's loss-masked tokens the first time, then loaded (checksum verified) so that later rounds
    keep the same draft ids."""
    cfg, store = ctx.config, ctx.store
    given = _given_vocab(cfg) if cfg.draft_vocab_file else None
    row = store.extraction.draft_vocab(ctx.tokenize_key, cfg.draft_vocab_size, vocab_id(given[2]) if given else None)
    if row is not None:
        path = ctx.workspace / row["file"]
        if file_sha256(path) != row["sha256"]:
            raise LineageError(f"draft vocab {path} does not match its recorded sha256; it was changed after it was built")
        return load_vocab(path), row["vocab_id"], json.loads(row["report"])
    items = store.generations.to_tokenise(cfg.generation_params_keys)
    if not items:
        raise LineageError("no generations to tokenise: run `eagle3 regenerate` first")
    halves = (TokenCounter(len(ctx.tokenizer)), TokenCounter(len(ctx.tokenizer)))  # alternate samples
    samples = 0
    for start in range(0, len(items), READ_CHUNK):
        for t in ctx.tokenise(items[start:start + READ_CHUNK]):
            if isinstance(t.result, Sample):
                halves[samples % 2].add(t.result.input_ids, t.result.loss_mask)
                samples += 1
    counts = halves[0].counts + halves[1].counts
    if given is None:
        vocab = build_draft_vocab(counts, cfg.draft_vocab_size)
        expected = split_half_coverage(halves[0].counts, halves[1].counts, cfg.draft_vocab_size)
        report = {**coverage_report(vocab), "expected_coverage": expected, "expected_from": "split-half",
                  "warning": thin_vocab_warning(vocab, expected)}
        rel = Path("vocab") / f"{ctx.tokenize_key}-{cfg.draft_vocab_size}.safetensors"
        save_vocab(vocab, ctx.workspace / rel)
    else:  # what it covers of this workspace's tokens is recorded, and later rounds are held to it
        vocab, data, digest = given
        if vocab.target_vocab_size != len(ctx.tokenizer):
            raise LineageError(f"draft_vocab_file {cfg.draft_vocab_file}: built for a target vocabulary of "
                               f"{vocab.target_vocab_size} tokens; this target's tokenizer has {len(ctx.tokenizer)}")
        report = coverage_report(vocab, counts)
        report.update({"expected_coverage": report["coverage"], "expected_from": "first use",
                       "given": cfg.draft_vocab_file, "built_coverage": vocab.coverage, "warning": None})
        rel = Path("vocab") / f"{ctx.tokenize_key}-{cfg.draft_vocab_size}-{digest[:16]}.safetensors"
        write_bytes_atomic(data, ctx.workspace / rel)  # byte for byte, so the same id
    digest = file_sha256(ctx.workspace / rel)
    vid = vocab_id(digest)
    store.extraction.register_draft_vocab(run_id, {
        "vocab_id": vid, "tokenize_key": ctx.tokenize_key, "file": str(rel), "sha256": digest,
        "draft_vocab_size": vocab.draft_vocab_size, "target_vocab_size": vocab.target_vocab_size,
        "coverage": report["coverage"], "counted_tokens": report["total_tokens"], "counted_samples": samples,
        "report": report})
    logger.info("draft vocab %s%s: %d of %d target tokens, coverage %.4f of %d loss-masked tokens from %d samples",
                vid, f" (from {cfg.draft_vocab_file})" if given else "", vocab.draft_vocab_size,
                vocab.target_vocab_size, report["coverage"], report["total_tokens"], samples)
    if report["warning"] is not None:
        logger.warning(report["warning"])
    return vocab, vid, report


def _given_vocab(cfg: ExtractConfig) -> tuple[DraftVocab, bytes, str]:
    """The `draft_vocab_file` vocab (validated on load), the file's bytes and their sha256, which names it (the
    workspace keeps a byte-for-byte copy, so the id is the same in every workspace that uses the file)."""
    path = Path(cfg.draft_vocab_file)
    try:
        data = path.read_bytes()
        vocab = load_vocab(path)
    except Exception as e:  # missing, not safetensors (safetensors' own error type), or not a valid vocab
        raise LineageError(f"draft_vocab_file {path}: {e}") from e
    if vocab.draft_vocab_size != cfg.draft_vocab_size:
        raise LineageError(f"draft_vocab_file {path} holds {vocab.draft_vocab_size} draft tokens; draft_vocab_size "
                           f"is {cfg.draft_vocab_size}: set it to {vocab.draft_vocab_size}")
    return vocab, data, hashlib.sha256(data).hexdigest()
