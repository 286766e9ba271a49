"""What a training round reads: its micro-batches' records, from shards or computed on the fly (online).

Owns the round's data as the training loop sees it: the records of a micro-batch's items, read from
the round's shards (checksum verified, one shard held in memory at a time, the first read of each
shard reported so that the loop can mark it consumed), or, in online mode, every generation's
sample tokenised as the extraction's settings say, its hidden states computed by the extractor at
each read. Promise: a sample the extractor quarantines is left out of its micro-batch and counted
(`RoundReader.quarantined`), never trained on.
"""

from __future__ import annotations

from pathlib import Path

from storage.datasets import read_generation_rows
from storage.lineage import LineageStore
from storage.shards import ShardStore
from tasks.extract.chat import Sample, tokenise_rows
from tasks.extract.hf_backend import Extracted
from tasks.extract.plan import read_shard
from tasks.train.steps import Item

ONLINE = "online"  # the source of an online item: its slot indexes the round's samples, not a shard


class RoundReader:
    """Records of a micro-batch's items: from the round's shards (checksums verified, one shard held
    at a time), or computed on the fly by the extractor (online mode)."""

    def __init__(self, shards: ShardStore | None, shard_rows: dict[str, dict], online: list[Sample] | None = None,
                 extractor=None, on_first_read=None) -> None:
        self.shards, self.rows, self.online, self.extractor = shards, shard_rows, online, extractor
        self.on_first_read = on_first_read
        self.quarantined = 0  # online: samples the extractor refused (their micro-batch trains on the rest)
        self._name: str | None = None
        self._records: list[Extracted] = []

    def records(self, items: list[Item], epoch: int) -> list[Extracted]:
        if items[0].source == ONLINE:
            samples = [(self.online[it.slot].input_ids, self.online[it.slot].loss_mask) for it in items]
            results = self.extractor.extract(samples)
            kept = [r for r in results if isinstance(r, Extracted)]
            self.quarantined += len(results) - len(kept)
            return kept
        name = items[0].source
        if name != self._name:
            self._records, _, _ = read_shard(self.shards, name, self.rows[name]["sha256"])
            self._name = name
            if self.on_first_read is not None:
                self.on_first_read(name, epoch)
        return [self._records[it.slot] for it in items]


def online_samples(store: LineageStore, ws: Path, tokenizer, template: str, settings: dict) -> list[Sample]:
    """Every generation's sample, tokenised as the extraction's settings say (online mode's round)."""
    items = store.generations.to_tokenise(settings.get("generation_params_keys"))
    rows = read_generation_rows(ws / "data" / "generations", [(g, f"{p}/{f}") for g, p, f in items])
    tokenised = tokenise_rows(tokenizer, rows, settings["max_length"], settings["overflow"], template)
    return [t.result for t in tokenised if isinstance(t.result, Sample)]
