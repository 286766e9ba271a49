"""Disk-bounded extraction rounds: which samples go into the next shard, and what the shard holds.

Owns the exact size a shard will have before any hidden state is computed, the choice of the
next shard's samples under both the shard size target and the room left in the disk budget, and
packing a batch of extraction results into one shard with its metadata. Promises: a planned shard's predicted size is
the size the store will write for those samples (quarantine only makes it smaller), so a round
stops *before* computing states that could not be stored. The stage's ids (tokenize key, extract
key, sample id) are in tasks/ids.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from storage.lineage import LineageStore
from storage.shards import OFFSETS_KEY, CorruptShard, ShardStore, encoded_size, pack_samples, unpack_samples
from tasks.extract.hf_backend import SHARD_FORMAT, Extracted, ExtractSettings, Quarantined, record_from_tensors, record_tensors


# ---------------------------------------------------------------- exact sizes


def _record_layout(tokens: int, settings: ExtractSettings, hidden_size: int) -> dict[str, torch.Tensor]:
    """Meta tensors shaped and typed as `HFExtractor` fills an `Extracted` of `tokens` tokens."""
    def t(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype, device="meta")

    out = {"input_ids": t(tokens, dtype=torch.int32), "loss_mask": t(tokens, dtype=torch.uint8)}
    if settings.storage == "fp8":
        out["aux_hidden"] = t(tokens, 3 * hidden_size, dtype=torch.float8_e4m3fn)
        out["aux_scale"] = t(tokens, dtype=torch.float32)
    else:
        out["aux_hidden"] = t(tokens, 3 * hidden_size, dtype=torch.bfloat16)
    if settings.teacher == "final_hidden":
        out["final_hidden"] = t(tokens, hidden_size, dtype=torch.bfloat16)
    else:
        out["topk_ids"] = t(tokens, settings.topk, dtype=torch.int32)
        out["topk_logprobs"] = t(tokens, settings.topk, dtype=torch.float16)
        out["argmax_in_draft"] = t(tokens, dtype=torch.bool)
    return out


def shard_metadata(extract: str, sample_ids: list[str], settings: ExtractSettings) -> dict[str, str]:
    """What makes a shard self-describing: format, key, settings and the sample id of each slot."""
    return {"format": SHARD_FORMAT, "extract_key": extract, "aux_layer_ids": json.dumps(settings.aux_layer_ids),
            "teacher": settings.teacher, "storage": settings.storage, "sample_ids": json.dumps(sample_ids)}


def predicted_shard_bytes(lengths: list[int], sample_ids: list[str], extract: str, settings: ExtractSettings,
                          hidden_size: int) -> int:
    """The exact file size of a shard holding samples of these lengths (nothing quarantined)."""
    layout = _record_layout(sum(lengths), settings, hidden_size)
    layout[OFFSETS_KEY] = torch.empty(len(lengths) + 1, dtype=torch.int64, device="meta")
    return encoded_size(layout, shard_metadata(extract, sample_ids, settings))


@dataclass(frozen=True)
class ShardPlan:
    count: int          # samples taken from the head of the queue (0: nothing fits the room left)
    predicted_bytes: int


def plan_shard(lengths: list[int], sample_ids: list[str], extract: str, settings: ExtractSettings, hidden_size: int,
               shard_bytes: int, room_bytes: int) -> ShardPlan:
    """The longest head of the queue whose shard stays within `shard_bytes` and `room_bytes`.

    One sample larger than `shard_bytes` still makes a shard of its own if the room allows:
    a size target must not strand a long sample forever. Size grows with the count, so a binary
    search finds the count in O(log n) size computations.
    """
    def size(n: int) -> int:
        return predicted_shard_bytes(lengths[:n], sample_ids[:n], extract, settings, hidden_size)

    if not lengths:
        return ShardPlan(0, 0)
    first = size(1)
    if first > room_bytes:
        return ShardPlan(0, first)
    cap = min(shard_bytes, room_bytes)
    lo, hi = 1, len(lengths)  # invariant: size(lo) fits, or lo == 1 (the oversize single sample)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if size(mid) <= cap:
            lo = mid
        else:
            hi = mid - 1
    return ShardPlan(lo, size(lo))


def pack_results(results: list[Extracted | Quarantined], sample_ids: list[str], extract: str,
                 settings: ExtractSettings) -> tuple[dict[str, torch.Tensor] | None, dict[str, str], list[int]]:
    """The shard tensors and metadata of the extracted results, and the input positions they hold.

    Quarantined results are left out; None when every result was quarantined.
    """
    kept = [i for i, r in enumerate(results) if isinstance(r, Extracted)]
    meta = shard_metadata(extract, [sample_ids[i] for i in kept], settings)
    if not kept:
        return None, meta, []
    return pack_samples([record_tensors(results[i]) for i in kept]), meta, kept  # type: ignore[arg-type]


def read_shard(shards: ShardStore, shard: str, sha256: str) -> tuple[list[Extracted], list[str], dict[str, str]]:
    """A registered shard's records, their sample ids and its metadata; the checksum is verified first."""
    tensors, meta = shards.read(shard, sha256)
    if meta.get("format") != SHARD_FORMAT:
        raise CorruptShard(shards.folder / shard, SHARD_FORMAT, meta.get("format"), "unknown shard format")
    ids = json.loads(meta["sample_ids"])
    parts = unpack_samples(tensors)
    if len(ids) != len(parts):
        raise CorruptShard(shards.folder / shard, str(len(ids)), str(len(parts)), "sample_ids and offsets disagree")
    return [record_from_tensors(t, i) for i, t in enumerate(parts)], ids, meta


def delete_consumed_shards(store: LineageStore, shards: ShardStore, names: list[str] | None = None) -> list[str]:
    """Delete the consumed shards (all, or those of `names`), freeing their bytes for the next round.

    The file goes first, then the lineage state: a crash in between leaves a consumed shard whose
    file is gone, and the next call just records the deletion.
    """
    deleted = []
    for name, row in store.extraction.live_shards().items():
        if row["state"] == "consumed" and (names is None or name in names):
            shards.delete(name)
            store.extraction.mark_shard_deleted(name)
            deleted.append(name)
    return deleted
