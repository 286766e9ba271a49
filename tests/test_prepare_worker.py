"""Discover's preparation in a worker process: the batch that comes back, failures, and when it is used."""

from __future__ import annotations

import pytest

import tasks.prepare_worker as prepare_worker
from storage.lineage import LineageStore
from tasks.config import HeldoutConfig, NearDedupeConfig
from tasks.decontaminate import EvalItem, NgramIndex
from tasks.outcomes import decide_and_write, decide_outcomes, prepare_batch
from tasks.prepare_worker import PrepareWorker, flatten, unflatten
from tasks.sources import RawRecord

FORMATS = {"chats": ("auto", "prompt", "response"), "pairs": ("prompt_response", "prompt", "response")}
EVAL_QUESTION = " ".join(f"secret{i}" for i in range(20))


def _varied_records() -> list[RawRecord]:
    """Every kind of prepared record: quarantined (unreadable, bad), contaminated, multi-turn with a
    system turn and a dropped leading assistant turn, non-ASCII, native ids, repeated texts."""
    return [
        RawRecord("chats", "c0", {"id": 7, "conversations": [
            {"from": "gpt", "value": "Hello, how can I help?"},
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "Naïve café question: what is ﬁve plus two?"},
            {"from": "gpt", "value": "Seven."},
            {"from": "human", "value": "And  times  three?"}]}),
        RawRecord("chats", "c1", {"messages": [{"role": "user", "content": "Ein  Straße\r\nmit Ümlaut " * 4}]}),
        RawRecord("chats", "c2", None, error="line 3: invalid JSON"),
        RawRecord("chats", "c3", {"messages": [{"role": "user", "content": ""}]}),
        RawRecord("pairs", "p0", {"prompt": "intro " + EVAL_QUESTION + " outro"}),
        RawRecord("pairs", "p1", {"prompt": "write a poem about the sea " * 3, "id": "n-1"}),
        RawRecord("pairs", "p2", {"prompt": "WRITE a poem  about the sea " * 3}),
        RawRecord("pairs", "p3", {"prompt": "write a poem about the sea " * 3}),
    ]


def _contamination() -> NgramIndex:
    return NgramIndex([EvalItem("user/q", EVAL_QUESTION)], 13)


def test_a_batch_prepared_in_the_worker_equals_one_prepared_here():
    records = _varied_records()
    here = prepare_batch(records, FORMATS, NearDedupeConfig(), _contamination())
    assert [r["outcome"] for r in here.rows if r] == ["quarantined", "quarantined", "contaminated"]
    assert {len(p.messages) for _, p in here.candidates} >= {1, 4} and len(here.signed) < len(here.candidates)

    rebuilt = unflatten(flatten(here), records)
    assert rebuilt.rows == here.rows and rebuilt.candidates == here.candidates and rebuilt.signed == here.signed
    assert (rebuilt.sig == here.sig).all() and (rebuilt.keys == here.keys).all()

    with PrepareWorker(FORMATS, NearDedupeConfig(), _contamination()) as worker:
        there = unflatten(worker.submit(records).result(), records)
    assert there.records is records
    assert there.rows == here.rows and there.candidates == here.candidates and there.signed == here.signed
    assert (there.sig == here.sig).all() and (there.keys == here.keys).all()


def test_decide_and_write_with_a_worker_stores_what_deciding_here_stores(tmp_path):
    chunks = [_varied_records()[:4], _varied_records()[4:], [RawRecord("pairs", "p9", {"prompt": "a new text " * 9})]]
    heldout = HeldoutConfig(fraction=0.5, cap=10)
    here = LineageStore(tmp_path / "here.duckdb")
    for chunk in chunks:
        batch = decide_outcomes(chunk, FORMATS, here, NearDedupeConfig(), _contamination(), heldout)
        here.write_discover_batch("run", batch.records, batch.prompts, batch.minhash)
    there = LineageStore(tmp_path / "there.duckdb")
    decide_and_write(chunks, "run", FORMATS, there, NearDedupeConfig(), _contamination(), heldout,
                     prepare_process=True)
    query = ("SELECT r.source, r.record_key, r.outcome, r.reason, r.prompt_id, r.duplicate_of, r.eval_item, "
             "r.native_id, p.messages FROM records r LEFT JOIN prompts p USING (prompt_id) ORDER BY 1, 2")
    expected = here.query_readonly(query)[1]
    assert {r[2] for r in expected} >= {"quarantined", "contaminated", "exact_duplicate", "kept"}
    assert there.query_readonly(query)[1] == expected


def test_a_batch_that_fails_in_the_worker_stops_discover_after_the_batches_before_it(tmp_path):
    store = LineageStore(tmp_path / "l.duckdb")
    chunks = [[RawRecord("pairs", "p0", {"prompt": "first text " * 6})],
              [RawRecord("unlisted", "u0", {"prompt": "a source with no format " * 3})],  # KeyError in prepare
              [RawRecord("pairs", "p1", {"prompt": "third text " * 6})]]
    with pytest.raises(KeyError, match="unlisted"):
        decide_and_write(chunks, "run", FORMATS, store, NearDedupeConfig(), None, prepare_process=True)
    assert store.query_readonly("SELECT record_key FROM records ORDER BY 1")[1] == [("p0",)]


def test_a_worker_starts_only_for_more_than_one_batch(tmp_path, monkeypatch):
    started = []

    class Counted(PrepareWorker):
        def __init__(self, *args):
            started.append(1)
            super().__init__(*args)

    monkeypatch.setattr(prepare_worker, "PrepareWorker", Counted)
    store = LineageStore(tmp_path / "l.duckdb")
    one = [[RawRecord("pairs", "p0", {"prompt": "only one batch " * 6})]]
    decide_and_write(one, "run", FORMATS, store, NearDedupeConfig(), None)
    assert started == []
    two = [[RawRecord("pairs", f"q{k}", {"prompt": f"batch {k} of two " * 6})] for k in range(2)]
    decide_and_write(two, "run", FORMATS, store, NearDedupeConfig(), None)
    assert started == [1]
    assert store.query_readonly("SELECT count(*) FROM records")[1] == [(3,)]
