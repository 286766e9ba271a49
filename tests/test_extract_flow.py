"""The extract flow end to end on a real Prefect API and a real DuckDB file: samples, vocab, shards
under a disk budget, rounds, NaN quarantine, kill -9 resume and checksums.

The target is a tiny random Llama saved as a transformers folder with SmolLM2's real tokenizer and
chat template (fast; exercises the `model_path` target), plus one run on the real SmolLM2.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from flows.extract import extract
from storage.lineage import LineageError, LineageStore
from storage.shards import CorruptShard, ShardStore
from tasks.extract.hf_backend import HFExtractor, aux_hidden_float
from tasks.extract.plan import delete_consumed_shards, read_shard

from helpers import conversations, extract_config, import_generations

pytestmark = pytest.mark.slow  # starts servers, vLLM or `eagle3` processes: not in `make test-fast`

ROOT = Path(__file__).resolve().parent.parent


def sample_rows(store: LineageStore) -> list[tuple]:
    return store.reports.query_readonly(
        "SELECT generation_id, outcome, shard, shard_index, sample_id, reason FROM samples ORDER BY generation_id")[1]


def shard_contents(workspace: Path, store: LineageStore) -> dict[str, list[str]]:
    """Sample ids held by each live shard, read back through its checksum."""
    shards = ShardStore(workspace / "shards", 1 << 40)
    out = {}
    for name, row in store.extraction.live_shards().items():
        _, ids, _ = read_shard(shards, name, row["sha256"])
        out[name] = ids
    return out


def assert_exactly_once(workspace: Path, store: LineageStore, n_generations: int) -> None:
    """Every generation has one sample row; every extracted sample is in exactly one shard, at its slot."""
    rows = sample_rows(store)
    gens = [r[0] for r in rows]
    assert len(gens) == len(set(gens)) == n_generations
    held = shard_contents(workspace, store)
    in_shards = [sid for ids in held.values() for sid in ids]
    assert len(in_shards) == len(set(in_shards))
    extracted = {r[4]: (r[2], r[3]) for r in rows if r[1] == "extracted"}
    assert set(in_shards) == set(extracted)
    for name, ids in held.items():
        for slot, sid in enumerate(ids):
            assert extracted[sid] == (name, slot)
    on_disk = sorted(p.name for p in (workspace / "shards").iterdir())
    assert on_disk == sorted(held)  # no leftovers, no temporaries


def test_extract_end_to_end_states_equal_a_direct_forward(prefect_api, tmp_path, workspace, tiny_target):
    convs = conversations(24, seed=1)
    convs.append({"messages": [{"role": "user", "content": "spell it"},
                               {"role": "assistant", "content": "it is <|im_end|> here"}]})  # skipped, with reason
    n = import_generations(workspace, tmp_path, convs)
    assert n == 25
    s = extract(extract_config(workspace, tiny_target))
    assert (s.extracted, s.skipped, s.quarantined) == (24, 1, 0)
    assert s.stopped_by == "done" and s.shards_written > 1 and s.aux_layer_ids == [1, 3, 4]
    assert s.target_dtype == "float32"  # as configured
    store = LineageStore(workspace / "lineage.duckdb")
    assert_exactly_once(workspace, store, 25)
    (reason,) = [r[5] for r in sample_rows(store) if r[1] == "skipped"]
    assert "special-token string" in reason

    # The shard's states are what a direct forward with output_hidden_states gives.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    name, row = next(iter(store.extraction.live_shards().items()))
    records, _, meta = read_shard(ShardStore(workspace / "shards", 1 << 40), name, row["sha256"])
    assert json.loads(meta["aux_layer_ids"]) == s.aux_layer_ids
    rec = records[-1]
    with torch.inference_mode():
        hs = model(input_ids=rec.input_ids.long()[None], output_hidden_states=True).hidden_states
    expect = torch.cat([hs[i + 1][0] for i in s.aux_layer_ids], dim=-1)
    torch.testing.assert_close(aux_hidden_float(rec), expect.bfloat16().float(), rtol=0, atol=0)
    torch.testing.assert_close(rec.final_hidden.float(), hs[-1][0].bfloat16().float(), rtol=0, atol=0)

    # The vocab and its lineage; a second run has nothing left to do and changes nothing.
    _, vocab = store.reports.query_readonly("SELECT draft_vocab_size, coverage, counted_samples FROM draft_vocabs")
    assert vocab[0][0] == 512 and 0 < vocab[0][1] <= 1 and vocab[0][2] == 24
    again = extract(extract_config(workspace, tiny_target))
    assert again.pending_at_start == 0 and again.shards_written == 0
    assert_exactly_once(workspace, store, 25)
    _, progress = store.reports.progress()
    extract_row = [r for r in progress if r[0] == "extract"][0]
    assert extract_row[1:4] == (24, 0, 1)  # done, pending, failed


def test_rounds_fill_the_budget_and_continue_after_consumed_shards_are_deleted(prefect_api, tmp_path, workspace, tiny_target):
    n = import_generations(workspace, tmp_path, conversations(30, seed=2))
    budget = 700_000
    cfg = extract_config(workspace, tiny_target, disk_budget_bytes=budget, shard_bytes=150_000)
    store = LineageStore(workspace / "lineage.duckdb")
    shards = ShardStore(workspace / "shards", budget)
    rounds, seen = 0, set()
    while True:
        s = extract(cfg)
        rounds += 1
        assert s.peak_disk_bytes <= budget and shards.used_bytes() <= budget
        live = store.extraction.live_shards()
        assert not set(live) & seen  # every round writes new shards; deleted ones never come back
        if s.stopped_by == "done":
            break
        assert s.stopped_by == "budget" and s.shards_written > 0
        # a training run reads the round, then frees it
        store.extraction.mark_shards_read("train-test", sorted(live), epoch=0)
        assert len(delete_consumed_shards(store, shards)) == len(live)
        seen |= set(live)
        assert rounds < 20
    assert rounds >= 3
    rows = sample_rows(store)
    assert len(rows) == len({r[0] for r in rows}) == n
    _, states = store.reports.query_readonly("SELECT state, count(*) FROM shards GROUP BY 1 ORDER BY 1")
    assert dict(states)["deleted"] >= 2
    with pytest.raises(Exception, match="never consumed"):
        store.extraction.mark_shard_deleted(next(k for k, v in store.extraction.live_shards().items() if v["state"] == "written"))


def test_a_vocab_fixed_on_a_thin_first_round_is_flagged_when_later_rounds_bring_tokens_it_lacks(
        prefect_api, tmp_path, workspace, tiny_target):
    # Round one answers with four words, round two with the helpers' varied text: the vocab, built on
    # round one and fixed since, cannot produce most of round two's tokens.
    few = [{"messages": [{"role": "user", "content": f"q{i} count"},
                         {"role": "assistant", "content": " ".join(["one two three four"] * (i + 2))}]} for i in range(6)]
    import_generations(workspace, tmp_path, few, name="first")
    cfg = extract_config(workspace, tiny_target)
    first = extract(cfg)
    assert first.extracted == 6 and first.extracted_vocab_coverage == first.vocab_coverage == 1.0
    assert first.vocab_warning is None
    store = LineageStore(workspace / "lineage.duckdb")
    _, built = store.reports.query_readonly(f"SELECT report FROM draft_vocabs WHERE vocab_id = '{first.vocab_id}'")
    assert "ids were never seen" in json.loads(built[0][0])["warning"]
    # four words, in both halves of the samples: each half's vocab covers the other; later rounds are judged by it
    assert json.loads(built[0][0])["expected_coverage"] == first.vocab_expected_coverage == 1.0

    import_generations(workspace, tmp_path, conversations(12, seed=5), name="second")
    second = extract(cfg)
    assert second.extracted == 12 and second.vocab_id == first.vocab_id
    assert second.extracted_vocab_coverage < 0.9
    assert f"covers {second.extracted_vocab_coverage:.1%} of the" in second.vocab_warning
    assert "against the 100.0% expected of new tokens" in second.vocab_warning
    _, runs = store.reports.query_readonly(f"SELECT summary FROM runs WHERE run_id = '{second.run_id}'")
    assert json.loads(runs[0][0])["vocab_warning"] == second.vocab_warning
    # The remedy the warning names: another size builds a vocab from every generation so far.
    rebuilt = extract(cfg.model_copy(update={"draft_vocab_size": cfg.draft_vocab_size + 1}))
    assert rebuilt.vocab_id != first.vocab_id and rebuilt.extracted == 18
    assert rebuilt.extracted_vocab_coverage == rebuilt.vocab_coverage and rebuilt.vocab_warning is None


def test_a_vocab_from_another_workspace_is_used_byte_for_byte_and_its_coverage_of_this_data_recorded(
        prefect_api, tmp_path, workspace, tiny_target):
    # Workspace A builds a vocab from varied data; workspace B, holding four-word answers only, is given it.
    import_generations(workspace, tmp_path, conversations(12, seed=5), name="varied")
    built = extract(extract_config(workspace, tiny_target))
    (vfile,) = LineageStore(workspace / "lineage.duckdb").reports.query_readonly(
        f"SELECT file FROM draft_vocabs WHERE vocab_id = '{built.vocab_id}'")[1][0]
    other = tmp_path / "other"
    other.mkdir()
    few = [{"messages": [{"role": "user", "content": f"q{i} count"},
                         {"role": "assistant", "content": " ".join(["one two three four"] * (i + 2))}]} for i in range(6)]
    import_generations(other, tmp_path, few, name="few")
    given = extract_config(other, tiny_target, draft_vocab_file=str(workspace / vfile))
    with pytest.raises(LineageError, match="holds 512 draft tokens; draft_vocab_size is 256: set it to 512"):
        extract(given.model_copy(update={"draft_vocab_size": 256}))
    (tmp_path / "not-a-vocab.safetensors").write_bytes(b"nonsense")
    with pytest.raises(LineageError, match="draft_vocab_file .*not-a-vocab.safetensors"):
        extract(given.model_copy(update={"draft_vocab_file": str(tmp_path / "not-a-vocab.safetensors")}))

    s = extract(given)
    assert s.vocab_id == built.vocab_id and s.extracted == 6  # the same bytes, so the same id
    assert s.vocab_coverage == built.vocab_coverage  # the coverage it was built with, in A
    store = LineageStore(other / "lineage.duckdb")
    _, rows = store.reports.query_readonly("SELECT file, coverage, counted_samples, report FROM draft_vocabs")
    assert len(rows) == 1 and rows[0][0] != vfile and (other / rows[0][0]).read_bytes() == (workspace / vfile).read_bytes()
    report = json.loads(rows[0][3])
    assert rows[0][2] == 6 and report["given"] == str(workspace / vfile)
    # what it records is its coverage of B's tokens, the ones this run extracted
    assert rows[0][1] == report["coverage"] == s.extracted_vocab_coverage != built.vocab_coverage
    assert s.vocab_expected_coverage == report["coverage"]  # a given vocab: later rounds are held to its first use
    # kept: a later run, given nothing, uses the vocab this workspace registered
    import_generations(other, tmp_path, conversations(3, seed=9), name="later")
    later = extract(extract_config(other, tiny_target))
    assert later.vocab_id == built.vocab_id and later.extracted == 3


def poison_aux_layer_1(monkeypatch, forward_call: int, poison) -> None:
    """Replace the aux-layer-1 states (`hidden_states[2]`) of the extractor's n-th forward by `poison(states)`."""
    real = HFExtractor._forward
    calls = {"n": 0}

    def poisoned(self, input_ids, attention):
        hs = list(real(self, input_ids, attention))
        calls["n"] += 1
        if calls["n"] == forward_call:
            hs[2] = poison(hs[2])
        return tuple(hs)

    monkeypatch.setattr(HFExtractor, "_forward", poisoned)


def test_non_finite_states_quarantine_exactly_that_sample(prefect_api, tmp_path, workspace, tiny_target, monkeypatch):
    import_generations(workspace, tmp_path, conversations(10, seed=3))

    def one_value(aux1):
        aux1 = aux1.clone()
        aux1[0, 0, 0] = float("nan")  # the first sample of the first batch
        return aux1

    poison_aux_layer_1(monkeypatch, forward_call=1, poison=one_value)
    s = extract(extract_config(workspace, tiny_target))
    assert (s.extracted, s.quarantined) == (9, 1)
    store = LineageStore(workspace / "lineage.duckdb")
    (row,) = [r for r in sample_rows(store) if r[1] == "quarantined"]
    assert row[2] is None and "non-finite values in aux layer 1" in row[5]
    assert_exactly_once(workspace, store, 10)


def test_a_shard_whose_samples_all_quarantine_does_not_let_a_later_run_reuse_a_live_name(
        prefect_api, tmp_path, workspace, tiny_target, monkeypatch):
    # One sample per shard; the second shard's sample is poisoned, so its number leaves no row.
    # Numbering the next run's shards by the count of rows would name one like a live shard.
    import_generations(workspace, tmp_path, conversations(6, seed=6))
    poison_aux_layer_1(monkeypatch, forward_call=2, poison=lambda aux1: torch.full_like(aux1, float("nan")))
    first = extract(extract_config(workspace, tiny_target, shard_bytes=1, limit=3))
    assert (first.extracted, first.quarantined, first.shards_written) == (2, 1, 2)
    second = extract(extract_config(workspace, tiny_target, shard_bytes=1))
    assert (second.extracted, second.shards_written) == (3, 3)
    store = LineageStore(workspace / "lineage.duckdb")
    names = sorted(store.extraction.live_shards())
    assert len(names) == len(set(names)) == 5
    assert_exactly_once(workspace, store, 6)


def test_a_corrupted_shard_is_detected_by_its_checksum(prefect_api, tmp_path, workspace, tiny_target):
    import_generations(workspace, tmp_path, conversations(6, seed=4))
    extract(extract_config(workspace, tiny_target))
    store = LineageStore(workspace / "lineage.duckdb")
    name, row = next(iter(store.extraction.live_shards().items()))
    path = workspace / "shards" / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit in the tensor data: safetensors alone would not notice
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptShard, match="sha256 mismatch"):
        read_shard(ShardStore(workspace / "shards", 1 << 40), name, row["sha256"])


def test_kill_9_during_extraction_then_resume_has_no_duplicates_or_gaps(prefect_api, tmp_path, workspace, tiny_target):
    n = import_generations(workspace, tmp_path, conversations(60, seed=5))
    cfg = {"workspace": str(workspace), "extract": extract_config(workspace, tiny_target, shard_bytes=60_000).model_dump(mode="json")}
    cfg["extract"].pop("workspace")
    path = tmp_path / "extract.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    store = LineageStore(workspace / "lineage.duckdb")
    shard_dir = workspace / "shards"
    kills = 0
    for delay_after_first_file in (0.0, 0.3, 0.8):
        proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "extract", "-c", str(path)], env=env, cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=open(tmp_path / "kill.log", "ab"))
        deadline = time.monotonic() + 120
        # wait until this run writes a new shard (or a temporary), then kill it at a varying moment
        before = set(os.listdir(shard_dir)) if shard_dir.exists() else set()
        while time.monotonic() < deadline and proc.poll() is None:
            if shard_dir.exists() and set(os.listdir(shard_dir)) - before:
                break
            time.sleep(0.01)
        time.sleep(delay_after_first_file)
        proc.send_signal(signal.SIGKILL)  # a no-op if the run has already ended
        # counted by how the run ended, not by the send: a run that finished between a check and the
        # signal is not a kill, and the CRASHED count below must match the kills that landed
        kills += proc.wait(timeout=30) == -signal.SIGKILL
    assert kills >= 2, (tmp_path / "kill.log").read_text()[-3000:]
    done = subprocess.run([sys.executable, "-m", "flows.cli", "extract", "-c", str(path)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_exactly_once(workspace, store, n)
    _, crashed = store.reports.query_readonly("SELECT count(*) FROM runs WHERE flow = 'extract' AND state = 'CRASHED'")
    assert crashed[0][0] == kills


def test_the_real_smollm2_target_with_fp8_and_topk(prefect_api, tmp_path, workspace):
    import_generations(workspace, tmp_path, conversations(4, seed=6))
    s = extract(extract_config(workspace, None, storage="fp8", teacher="topk", topk=8, draft_vocab_size=256))
    assert s.extracted == 4 and s.aux_layer_ids == [1, 14, 26]
    # The default `target.dtype: auto`: bf16 where this CPU computes it, float32 where it would be emulated.
    from tasks.model.target import resolve_target_dtype

    assert s.target_dtype == resolve_target_dtype("auto", "cpu")
    store = LineageStore(workspace / "lineage.duckdb")
    name, row = next(iter(store.extraction.live_shards().items()))
    records, _, meta = read_shard(ShardStore(workspace / "shards", 1 << 40), name, row["sha256"])
    rec = records[0]
    assert rec.aux_hidden.dtype == torch.float8_e4m3fn and rec.aux_hidden.shape[1] == 3 * 576
    assert rec.topk_ids.shape[1] == 8 and rec.final_hidden is None
    from tasks.extract.vocab import load_vocab

    (vfile,) = store.reports.query_readonly("SELECT file FROM draft_vocabs")[1][0]
    vocab = load_vocab(workspace / vfile)
    assert vocab.t2d[rec.topk_ids.long().numpy()].all()  # the teacher only names draft-vocab tokens
