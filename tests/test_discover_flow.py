"""The discover flow on real files, a real DuckDB file and a real Prefect API."""

from __future__ import annotations

import gzip
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from flows.discover import discover
from storage.lineage import LineageStore
from tasks.config import DiscoverConfig, load_config
from tasks.discover.decontaminate import humaneval_items

pytestmark = pytest.mark.slow  # starts servers, vLLM or `eagle3` processes: not in `make test-fast`

ROOT = Path(__file__).resolve().parent.parent
EAGLE3 = [sys.executable, "-m", "flows.cli"]

rng = random.Random(7)
WORDS = [f"word{i}" for i in range(5000)]
LONG = " ".join(rng.choice(WORDS) for _ in range(150))
LONG_EDITED = LONG.replace(LONG.split()[75], "changed", 1)


def sg(key: str, *turns) -> dict:
    return {"id": key, "conversations": [{"from": r, "value": v} for r, v in turns]}


def write_catalog(d: Path) -> dict:
    """A mixed catalog; returns the expected outcome of every record by (source, record_key)."""
    he = humaneval_items()[3].text
    chat = [
        sg("k1", ("human", "How do I sort a list in Python?"), ("gpt", "Use sorted().")),  # kept
        sg("k2", ("human", "how do I   SORT a list in python?"), ("gpt", "Other answer")),  # exact dup of k1
        sg("k3", ("human", LONG), ("gpt", "ok")),  # kept
        sg("k4", ("human", LONG_EDITED), ("gpt", "ok")),  # near dup of k3
        sg("k5", ("human", "Please finish this:\n" + he), ("gpt", "...")),  # contaminated
        sg("k6", ("human", "hi"), ("robot", "beep")),  # quarantined: unknown role
        sg("k7", ("gpt", "Hello, how can I help?")),  # quarantined: no user turn
        sg("k8", ("gpt", "Welcome!"), ("human", "What is a monad?"), ("gpt", "...")),  # kept, leading turn dropped
    ]
    text = json.dumps(chat, indent=2)
    (d / "chat.json").write_text(text[: text.rindex('"What is a monad?"')] + '"What is a monad?"')  # cut inside k8
    lines = [
        json.dumps({"messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Explain DNS."}]}),
        "{broken json",
        json.dumps({"messages": [{"role": "user", "content": ""}]}),
        json.dumps({"messages": [{"role": "user", "content": "How do I sort a list in Python?"}]}),  # exact dup across sources
    ]
    with gzip.open(d / "msgs.jsonl.gz", "wt") as f:
        f.write("\n".join(lines) + "\n")
    pq.write_table(pa.table({"instruction": ["Name three primes.", "Name three primes."], "input": ["", "  "], "output": ["2, 3, 5", "x"]}), d / "alpaca.parquet")
    return {
        ("chat", "#0"): "kept", ("chat", "#1"): "exact_duplicate", ("chat", "#2"): "kept",
        ("chat", "#3"): "near_duplicate", ("chat", "#4"): "contaminated", ("chat", "#5"): "quarantined",
        ("chat", "#6"): "quarantined", ("chat", "#7"): "quarantined",  # k8 is the cut record
        ("msgs", "L1"): "kept", ("msgs", "L2"): "quarantined", ("msgs", "L3"): "quarantined",
        ("msgs", "L4"): "exact_duplicate",
        ("alpaca", "g0r0"): "kept", ("alpaca", "g0r1"): "exact_duplicate",
    }


def catalog_config(d: Path, ws: Path, **extra) -> DiscoverConfig:
    return DiscoverConfig.model_validate({
        "workspace": str(ws),
        "sources": [
            {"name": "chat", "kind": "file", "path": str(d / "chat.json")},
            {"name": "msgs", "kind": "file", "path": str(d / "msgs.jsonl.gz")},
            {"name": "alpaca", "kind": "file", "path": str(d / "alpaca.parquet")},
        ],
        **extra,
    })


def outcomes(ws: Path) -> dict:
    _, rows = LineageStore(ws / "lineage.duckdb").reports.query_readonly("SELECT source, record_key, outcome FROM record_outcomes")
    return {(s, k): o for s, k, o in rows}


def test_every_record_gets_its_outcome_and_counts_reconcile(prefect_api, tmp_path, workspace):
    expected = write_catalog(tmp_path)
    summary = discover(catalog_config(tmp_path, workspace))
    assert outcomes(workspace) == expected
    assert summary.reconciles and summary.records_in == len(expected)
    assert summary.outcomes == {"kept": 4, "heldout": 0, "exact_duplicate": 3, "near_duplicate": 1, "contaminated": 1, "quarantined": 5}
    assert any("file ends inside record #7" in t for t in summary.truncated_sources)

    store = LineageStore(workspace / "lineage.duckdb")
    _, rows = store.reports.query_readonly(
        "SELECT record_key, reason, duplicate_of, eval_item FROM record_outcomes WHERE source = 'chat' ORDER BY record_key")
    by_key = {r[0]: r[1:] for r in rows}
    k1_id = store.reports.query_readonly("SELECT prompt_id FROM record_outcomes WHERE source='chat' AND record_key='#0'")[1][0][0]
    k3_id = store.reports.query_readonly("SELECT prompt_id FROM record_outcomes WHERE source='chat' AND record_key='#2'")[1][0][0]
    assert by_key["#1"][1] == k1_id and by_key["#3"][1] == k3_id
    assert by_key["#4"][2] == "humaneval/HumanEval/3"
    assert by_key["#5"][0] == "turn 1: unknown role 'robot'" and by_key["#6"][0] == "no user turn"
    assert by_key["#7"][0].startswith("truncated")
    _, reads = store.reports.query_readonly("SELECT source, complete, stop_reason FROM source_reads ORDER BY source")
    assert [(s, c) for s, c, _ in reads] == [("alpaca", True), ("chat", False), ("msgs", True)]

    # The dataset is a Parquet file that `datasets` reads, one row per kept prompt.
    import datasets

    ds = datasets.load_dataset("parquet", data_files=summary.dataset, split="train")
    assert len(ds) == 4 and set(ds.column_names) >= {"prompt_id", "messages", "source", "record_key"}
    assert not [r for r in ds if "monad" in r["messages"][-1]["content"]]  # k8 was cut, so it is quarantined, not kept
    dns = [r for r in ds if r["source"] == "msgs"][0]
    assert dns["messages"] == [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Explain DNS."}]

    # The run is tied to its Prefect flow run, which holds the outcome table artifact.
    _, runs = store.reports.query_readonly("SELECT flow_run_id, state, config_hash FROM runs")
    flow_run_id, state, chash = runs[0]
    assert state == "COMPLETED" and chash and flow_run_id
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        assert str(client.read_flow_run(flow_run_id).id) == flow_run_id
        arts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    table = next(a for a in arts if a.key == "discover-outcomes")
    data = json.loads(table.data) if isinstance(table.data, str) else table.data
    assert {"outcome": "kept", "records": 4} in data
    assert any(a.type == "progress" for a in arts)


def test_rerun_adds_nothing_and_a_second_batch_adds_only_what_is_new(prefect_api, tmp_path, workspace):
    write_catalog(tmp_path)
    cfg = catalog_config(tmp_path, workspace)
    discover(cfg)
    before = outcomes(workspace)
    again = discover(cfg)
    assert again.records_in == 0 and again.already_seen == len(before)
    assert outcomes(workspace) == before

    nightly = tmp_path / "nightly.jsonl"
    nightly.write_text("".join(json.dumps(r) + "\n" for r in [
        {"prompt": "A brand new question about Rust lifetimes?"},
        {"prompt": "HOW do i sort a list in python?"},  # exact dup of a stored prompt
        {"prompt": LONG_EDITED.replace(LONG.split()[20], "different", 1)},  # near dup of a stored prompt
        {"prompt": "A brand new question about Rust lifetimes?"},  # dup inside the batch
    ]))
    cfg2 = cfg.model_copy(update={"sources": cfg.sources + [DiscoverConfig.model_validate(
        {"sources": [{"name": "nightly", "kind": "file", "path": str(nightly)}]}).sources[0]]})
    summary = discover(cfg2)
    assert summary.records_in == 4 and summary.already_seen == len(before)
    after = outcomes(workspace)
    assert {k: v for k, v in after.items() if k[0] == "nightly"} == {
        ("nightly", "L1"): "kept", ("nightly", "L2"): "exact_duplicate",
        ("nightly", "L3"): "near_duplicate", ("nightly", "L4"): "exact_duplicate",
    }
    store = LineageStore(workspace / "lineage.duckdb")
    _, rows = store.reports.query_readonly(
        "SELECT n.duplicate_of = k.prompt_id FROM record_outcomes n, record_outcomes k "
        "WHERE n.source = 'nightly' AND n.record_key = 'L3' AND k.source = 'chat' AND k.record_key = '#2'")
    assert rows == [(True,)]
    assert store.reports.query_readonly("SELECT count(*) FROM prompts")[1] == [(5,)]


def test_changed_near_dedupe_parameters_backfill_stored_signatures(prefect_api, tmp_path, workspace):
    write_catalog(tmp_path)
    discover(catalog_config(tmp_path, workspace))
    nightly = tmp_path / "n.jsonl"
    # Another edit of chat #2: LONG_EDITED itself is chat #3, whose exact twin is an exact duplicate.
    nightly.write_text(json.dumps({"prompt": LONG_EDITED.replace(LONG.split()[20], "different", 1)}) + "\n")
    cfg = catalog_config(tmp_path, workspace, near_dedupe={"ngram": 3, "num_perm": 64})
    cfg = cfg.model_copy(update={"sources": [DiscoverConfig.model_validate(
        {"sources": [{"name": "n", "kind": "file", "path": str(nightly)}]}).sources[0]]})
    discover(cfg)
    # Without the backfill no stored prompt would have a signature under the new parameters,
    # and this near duplicate of chat #2 would be kept.
    assert outcomes(workspace)[("n", "L1")] == "near_duplicate"
    _, rows = LineageStore(workspace / "lineage.duckdb").reports.query_readonly(
        "SELECT params, sum(rows) FROM minhash_segments GROUP BY 1 ORDER BY 1")
    assert [r[1] for r in rows] == [4, 4] and len({r[0] for r in rows}) == 2


def test_the_real_sharegpt_file_end_to_end(prefect_api, workspace):
    cfg = DiscoverConfig.model_validate({"workspace": str(workspace), "sources": [{"name": "sharegpt", "kind": "sharegpt_package"}]})
    summary = discover(cfg)
    assert summary.records_in == summary.records_read == 17_672
    assert summary.reconciles
    assert summary.outcomes["kept"] > 15_000
    assert summary.outcomes["quarantined"] >= 1 and summary.outcomes["exact_duplicate"] > 0
    assert summary.truncated_sources and "file ends inside record #17671" in summary.truncated_sources[0]


def test_flow_parameters_are_a_typed_form(prefect_api):
    from prefect.utilities.callables import parameter_schema

    schema = parameter_schema(discover.fn).model_dump()
    assert list(schema["properties"]) == ["config"]
    defs = schema.get("definitions") or schema.get("$defs")
    assert {"sources", "near_dedupe", "decontaminate", "seed"} <= set(defs["DiscoverConfig"]["properties"])


# ------------------------------------------------------------------ the command line


def eagle3(*args: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run([*EAGLE3, *args], capture_output=True, text=True, cwd=ROOT, timeout=600, **kw)
    if check:
        assert out.returncode == 0, out.stdout + out.stderr
    return out


def test_config_errors_name_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"discover": {"sources": [{"name": "x", "kind": "ftp"}], "near_dedupe": {"threshold": 2}}}))
    out = eagle3("discover", "--config", str(bad), check=False)
    assert out.returncode == 2
    assert "field discover.sources.0.kind" in out.stderr and "field discover.near_dedupe.threshold" in out.stderr
    bad.write_text(yaml.safe_dump({"discover": {"sources": [{"name": "x", "kind": "file", "path": "a", "limt": 3}]}}))
    assert "field discover.sources.0.limt: Extra inputs are not permitted" in eagle3("discover", "--config", str(bad), check=False).stderr


def test_demo_config_is_valid():
    cfg = load_config(ROOT / "configs" / "demo.yaml")
    assert cfg.discover.sources[0].kind == "sharegpt_package"


def test_cli_discover_sql_and_status(prefect_api, tmp_path, workspace):
    write_catalog(tmp_path)
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(yaml.safe_dump({"workspace": str(workspace), "discover": catalog_config(tmp_path, workspace).model_dump(mode="json")}))
    out = eagle3("discover", "--config", str(cfg_path))
    assert "counts reconcile: 14 in = 4 kept + 3 exact_duplicate + 1 near_duplicate" in " ".join(out.stdout.split())
    csv_out = eagle3("sql", "-w", str(workspace), "-f", "csv", "SELECT outcome, count(*) AS n FROM record_outcomes GROUP BY 1 ORDER BY 1").stdout
    assert csv_out.splitlines() == ["outcome,n", "contaminated,1", "exact_duplicate,3", "kept,4", "near_duplicate,1", "quarantined,5"]
    js = json.loads(eagle3("status", "-w", str(workspace), "-f", "json").stdout)
    assert js[0]["stage"] == "discover" and js[0]["done"] == 9 and js[0]["failed"] == 5
    refused = eagle3("sql", "-w", str(workspace), "DELETE FROM records", check=False)
    assert refused.returncode == 2 and "read-only" in refused.stderr
    assert eagle3("sql", "-w", str(tmp_path / "nowhere"), "SELECT 1", check=False).returncode == 2


def test_kill_9_during_discover_then_resume_loses_and_duplicates_nothing(prefect_api, tmp_path, workspace):
    n = 12_000
    rows = [{"prompt": " ".join(rng.choice(WORDS) for _ in range(30)) + f" item {i}"} for i in range(n)]
    rows += rows[:500]  # exact duplicates too
    (tmp_path / "big.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(yaml.safe_dump({"workspace": str(workspace), "discover": {
        "write_batch_records": 500, "sources": [{"name": "big", "kind": "file", "path": str(tmp_path / "big.jsonl")}]}}))
    store = LineageStore(workspace / "lineage.duckdb")

    def stored() -> int:
        return store.reports.query_readonly("SELECT count(*) FROM records")[1][0][0] if store.path.exists() else 0

    for attempt in range(3):  # kill it at three different points
        # Each kill lands after this attempt itself wrote 1,000 records, so its run is registered:
        # an absolute target the previous kill overshot would kill the next attempt at its start. The
        # step is small against the 12,500 rows: on a busy machine a read of the store waits for the
        # writer's lock and a kill overshoots its target by several batches, and the third attempt
        # must still find work left to be killed in.
        target = stored() + 1_000
        err = tmp_path / f"discover-{attempt}.err"
        with err.open("w") as stderr:
            p = subprocess.Popen([*EAGLE3, "discover", "--config", str(cfg_path)], cwd=ROOT, stdout=subprocess.DEVNULL,
                                 stderr=stderr)
        deadline = time.time() + 300
        while time.time() < deadline and p.poll() is None:
            if (workspace / "lineage.duckdb").exists():
                try:
                    if stored() >= target:
                        break
                except Exception:
                    pass
            time.sleep(0.2)
        if p.poll() is not None:  # seen once on a loaded machine (ProcessLookupError at the kill): say how it ended
            pytest.fail(f"attempt {attempt}: discover exited with {p.returncode} before the kill, at {stored():,} of "
                        f"{len(rows):,} records (target {target:,}); its stderr ends: {err.read_text()[-1500:]}")
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
    partial = stored()
    assert 0 < partial < len(rows)  # the kills really landed mid-run
    eagle3("discover", "--config", str(cfg_path))
    _, counts = store.reports.query_readonly("SELECT count(*), count(DISTINCT record_key) FROM records")
    assert counts == [(len(rows), len(rows))]
    _, per = store.reports.query_readonly("SELECT outcome, count(*) FROM records GROUP BY 1 ORDER BY 1")
    assert dict(per) == {"exact_duplicate": 500, "kept": n}
    assert store.reports.query_readonly("SELECT count(*), count(DISTINCT prompt_id) FROM prompts")[1] == [(n, n)]
    assert len(pq.read_table(workspace / "data" / "prompts" / "prompts.parquet")) == n
    _, states = store.reports.query_readonly("SELECT state, count(*) FROM runs GROUP BY 1 ORDER BY 1")
    assert dict(states) == {"COMPLETED": 1, "CRASHED": 3}  # the killed runs are marked, not left RUNNING


def test_a_missing_source_file_is_one_clear_line(prefect_api, tmp_path, workspace):
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(yaml.safe_dump({"workspace": str(workspace), "discover": {
        "sources": [{"name": "gone", "kind": "file", "path": str(tmp_path / "gone.jsonl")}]}}))
    out = eagle3("discover", "--config", str(cfg_path), check=False)
    assert out.returncode == 2
    assert "SourceError: source 'gone': file not found" in " ".join(out.stderr.split())


def test_sources_are_read_one_at_a_time_each_decided_before_the_next(prefect_api, tmp_path, workspace, monkeypatch):
    """Memory at scale: holding every source's records at once took ~7 GB at 1M records."""
    import flows.discover as discover_module
    from prefect import task

    write_catalog(tmp_path)
    decided_when_read = {}

    def read_and_look(src):
        db = workspace / "lineage.duckdb"
        decided_when_read[src.name] = (LineageStore(db).reports.query_readonly("SELECT count(*) FROM records")[1][0][0]
                                       if db.exists() else 0)
        from tasks.discover.sources import read_source
        return read_source(src)

    monkeypatch.setattr(discover_module, "read_local_task", task(read_and_look, name="read-source"))
    summary = discover(catalog_config(tmp_path, workspace))
    assert summary.reconciles
    # chat's 8 records are decided and written before msgs is read, and msgs' 4 before alpaca.
    assert decided_when_read == {"chat": 0, "msgs": 8, "alpaca": 12}


def test_a_total_limit_still_shares_records_by_source_size(prefect_api, tmp_path, workspace):
    write_catalog(tmp_path)
    summary = discover(catalog_config(tmp_path, workspace, total_limit=6))
    assert summary.records_in == 6 and summary.not_sampled == 14 - 6 and summary.reconciles


def test_decide_batches_reach_the_task_without_prefect_walking_every_record(prefect_api, tmp_path, workspace,
                                                                            monkeypatch):
    """Prefect walks a task's parameters for futures; over 20K nested records that was 43% of discover."""
    import prefect.task_engine
    from tasks.discover.sources import RawRecord

    walked = []
    visit = prefect.task_engine.visit_collection

    def watching(expr, *args, **kwargs):
        first = expr[0] if isinstance(expr, list) and expr else None
        if isinstance(first, list) and first:  # the batches of a source
            first = first[0]
        if isinstance(first, RawRecord):
            walked.append(len(expr))
        return visit(expr, *args, **kwargs)

    monkeypatch.setattr(prefect.task_engine, "visit_collection", watching)
    write_catalog(tmp_path)
    assert discover(catalog_config(tmp_path, workspace)).records_in == 14
    assert walked == []
