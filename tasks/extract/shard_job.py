"""One planned shard as a unit of work: extract its samples, pack them, write the file, report back.

Owns the one code path that turns a planned shard into a file, whichever process runs it (the
flow's own, or an extraction worker), and the per-process cache of the worker's extractor.
Promises: a job never touches the lineage store (DuckDB has one writer: the flow commits what the
job returns); a sample's stored record does not depend on which process or batch extracted it;
the returned `ShardOutcome` is small and picklable; a worker loads its target once per identity
(target config and expected model identity, extraction settings, vocab checksum), holds one at a
time, and checks that it is the target the flow tokenised for.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from storage.datasets import file_sha256
from storage.shards import ShardInfo, ShardStore
from tasks.config import TargetConfig
from tasks.extract.hf_backend import Extracted, Extractor, ExtractSettings, Sample, build_extractor
from tasks.extract.plan import pack_results
from tasks.model.target import load_configured_target
from tasks.extract.vocab import load_vocab


@dataclass(frozen=True)
class ShardJob:
    """A planned shard: its file name and its samples, in slot order before quarantine."""

    name: str
    extract_key: str
    settings: ExtractSettings
    sample_ids: list[str]
    samples: list[Sample]  # (input_ids, loss_mask) per sample


@dataclass(frozen=True)
class ShardOutcome:
    """What the flow needs to commit a job: the file (None if every sample was quarantined), the
    job positions the file holds in slot order, and per job position None (extracted) or the
    quarantine reason."""

    name: str
    shard: ShardInfo | None
    kept: list[int]
    reasons: list[str | None]
    pid: int          # the process that ran the job
    seconds: float


def run_shard_job(extractor: Extractor, shards: ShardStore, job: ShardJob) -> ShardOutcome:
    """Extract the job's samples and write its shard (atomically, within the store's budget)."""
    started = time.monotonic()
    results = extractor.extract(job.samples)
    tensors, meta, kept = pack_results(results, job.sample_ids, job.extract_key, job.settings)
    info = shards.write(job.name, tensors, meta) if tensors is not None else None
    reasons = [None if isinstance(r, Extracted) else r.reason for r in results]
    return ShardOutcome(job.name, info, kept, reasons, os.getpid(), time.monotonic() - started)


# ---------------------------------------------------------------- the worker side


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs to build the flow's extractor by itself."""

    target: TargetConfig
    backend: str
    settings: ExtractSettings
    max_batch_tokens: int
    vocab_path: str
    vocab_sha256: str
    identity: tuple[str, str, str]  # (name, revision, template_id) the flow tokenised with
    threads: int | None = None      # torch intra-op threads in this process (None: leave as is)

    def cache_key(self) -> str:
        # The identity too: a long-lived worker must reload (and recheck) when the model behind the
        # same path changed between two flow runs.
        return json.dumps({"target": self.target.model_dump(mode="json"), "backend": self.backend,
                           "settings": asdict(self.settings), "max_batch_tokens": self.max_batch_tokens,
                           "vocab_sha256": self.vocab_sha256, "identity": list(self.identity)}, sort_keys=True)


# One entry at most: a long-lived worker (an external Dask cluster) asked for another target frees
# the old one first instead of holding two models.
_EXTRACTORS: dict[str, Extractor] = {}


def worker_extractor(spec: WorkerSpec) -> Extractor:
    """This process's extractor for `spec`, loaded on first use and kept for the next jobs."""
    key = spec.cache_key()
    cached = _EXTRACTORS.get(key)
    if cached is not None:
        return cached
    _EXTRACTORS.clear()
    t = spec.target
    model, tokenizer, identity = load_configured_target(t.gguf, t.model_path, t.revision, t.trust_remote_code,
                                                        t.dtype, t.device)
    loaded = (identity.name, identity.revision, identity.template_id)
    if loaded != tuple(spec.identity):
        # A worker on another machine may see another model under the same path: its states
        # would not belong to the samples the flow tokenised.
        raise RuntimeError(f"worker {os.getpid()} loaded target {loaded}, but the flow tokenised for {spec.identity}")
    path = Path(spec.vocab_path)
    if file_sha256(path) != spec.vocab_sha256:
        raise RuntimeError(f"draft vocab {path} as this worker sees it does not match its recorded sha256")
    extractor = build_extractor(spec.backend, model, tokenizer, spec.settings, torch.from_numpy(load_vocab(path).t2d),
                                spec.max_batch_tokens)
    _EXTRACTORS[key] = extractor
    return extractor


def run_shard_job_on_worker(spec: WorkerSpec, shard_folder: str, disk_budget_bytes: int, job: ShardJob) -> ShardOutcome:
    """`run_shard_job` with this process's cached extractor, in an extraction worker."""
    if spec.threads is not None:
        # Per call: OpenMP thread counts are per calling thread, and the worker's executor thread
        # is not the one that imported torch; Dask also starts workers with OMP_NUM_THREADS=1.
        torch.set_num_threads(spec.threads)
    return run_shard_job(worker_extractor(spec), ShardStore(Path(shard_folder), disk_budget_bytes), job)
