"""When the server cannot serve: a dead embedded server, an outage of every endpoint, an install
whose server cannot run on this CPU. All against real processes: the llama.cpp server on SmolLM2,
the scripted server on loopback, `eagle3 check-install` as a subprocess.

What must hold: the stage stops within seconds with the cause (a signal by name, the endpoints and
their last errors), nothing is recorded as failed because of it, and the same command resumes with
every prompt generated exactly once.
"""

from __future__ import annotations

import asyncio
import os
import re
import resource
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest

from flows.regenerate import regenerate
from serving.client import EndpointsDown
from serving.llamacpp.server import LlamaCppServer, ServerDied, describe_exit, free_port
from serving.llamacpp.install_check import CheckReport, check_portable, non_portable_instructions
from serving.scripted_server import spawn
from storage.lineage import LineageStore
from tasks.config import RegenerateConfig
from test_regenerate import conversations, discover_prompts, expected_all_mode, generated, regen_config

pytestmark = pytest.mark.slow  # starts servers, vLLM or `eagle3` processes: not in `make test-fast`

ROOT = Path(__file__).resolve().parent.parent
EAGLE3 = str(Path(sys.executable).with_name("eagle3"))


@pytest.fixture(autouse=True)
def no_core_files():
    """A server killed with SIGILL would dump core where the machine allows it: not in tests."""
    old = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (0, old[1]))
    yield
    resource.setrlimit(resource.RLIMIT_CORE, old)


def test_describe_exit_names_the_signal_and_what_it_means():
    assert describe_exit(3) == "exited with code 3"
    ill = describe_exit(-signal.SIGILL)
    assert "SIGILL (4)" in ill and "instruction this CPU cannot run" in ill and "make install" in ill
    assert "SIGKILL (9)" in describe_exit(-signal.SIGKILL)


# ---------------------------------------------------------------- the embedded server dies

def _server_pid(port: int, timeout_s: float = 60.0) -> int:
    """The pid of the llama-server program listening on `port` (found by its command line; not its watcher)."""
    needle = f"--port\x00{port}\x00".encode()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    cmdline = (entry / "cmdline").read_bytes()
                except OSError:
                    continue
                if cmdline.split(b"\x00")[0].endswith(b"/llama-server") and needle in cmdline + b"\x00":
                    return int(entry.name)
        time.sleep(0.1)
    raise AssertionError(f"no llama.cpp server on port {port}")


@pytest.mark.timeout(600)  # a guard, not a timing: a loaded 2-core machine takes minutes
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGILL], ids=["SIGKILL", "SIGILL"])
def test_a_server_that_dies_mid_run_stops_the_stage_in_seconds_and_a_rerun_finishes(prefect_api, tmp_path, workspace, sig):
    # Enough work (16 answers of up to 48 tokens, two at a time) that the kill below lands mid-run even
    # when the machine is busy and the killer's reads of the store are slow.
    rows = [{"id": f"q{i}", "conversations": [{"from": "human", "value": f"Write a short story about the number {i}."}]}
            for i in range(16)]
    prompts = discover_prompts(workspace, tmp_path, rows)
    port = free_port()
    cfg = RegenerateConfig.model_validate({
        "workspace": str(workspace), "target_model": "SmolLM2-135M-Instruct",
        "embedded_server": {"port": port, "n_ctx": 1024}, "write_batch": 1,
        "sampling": {"temperature": 0.0, "max_tokens": 48, "repeat_penalty": 1.0}})
    log = workspace / "logs" / "llama-server.log"
    store = LineageStore(workspace / "lineage.duckdb")
    killed_at: list[float] = []

    def kill_after_first_commit() -> None:
        # Waits for the state the test asserts (a generation committed in lineage), not for the server's
        # log: llama-server logs an answer's end before the client has received and committed it, so a
        # kill on the log line could land before anything was committed (seen on a busy machine).
        pid = _server_pid(port, timeout_s=300)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if store.reports.query_readonly("SELECT count(*) FROM generations")[1][0][0] >= 1:
                break
            time.sleep(0.05)
        os.kill(pid, sig)  # as the CPU does for an instruction it lacks, or the OOM killer
        killed_at.append(time.monotonic())

    killer = threading.Thread(target=kill_after_first_commit, daemon=True)
    killer.start()
    with pytest.raises(ServerDied) as err:
        regenerate(cfg)
    stopped_after = time.monotonic() - killed_at[0]
    killer.join(5)
    assert stopped_after < 10, f"the stage took {stopped_after:.1f} s to notice the dead server"
    message = str(err.value)
    assert f"signal {sig.name}" in message and "last lines" in message and str(log) in message

    _, runs = store.reports.query_readonly("SELECT state FROM runs WHERE flow = 'regenerate' ORDER BY started_at")
    assert runs == [("FAILED",)]
    # nothing was recorded as failed because the server died: the rest is simply pending
    assert store.reports.query_readonly("SELECT count(*) FROM generation_failures")[1] == [(0,)]
    done_before = len(generated(workspace))
    assert 1 <= done_before < len(prompts)

    summary = regenerate(cfg)  # the same command resumes
    assert summary.pending_at_start == len(prompts) - done_before
    assert summary.generated == summary.pending_at_start and summary.failed == 0
    assert set(generated(workspace)) == {pid for pid, _ in prompts}  # each exactly once (generated() checks)


@pytest.mark.timeout(120)
def test_guard_cancels_the_work_when_the_server_exits(tmp_path):
    from tasks.model.target import smollm2_gguf_path

    requests_sent = 0

    async def keep_asking(url: str) -> None:
        nonlocal requests_sent
        async with httpx.AsyncClient(timeout=30) as client:
            while True:
                requests_sent += 1
                try:
                    await client.post(url + "/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": "Count to twenty."}], "max_tokens": 16})
                except httpx.HTTPError:
                    await asyncio.sleep(0.2)  # what a retrying client does: it would never stop

    with LlamaCppServer(smollm2_gguf_path(), n_ctx=512, log_path=tmp_path / "s.log") as server:
        threading.Timer(1.0, os.kill, (server.pid, signal.SIGKILL)).start()
        started = time.monotonic()
        with pytest.raises(ServerDied, match="SIGKILL"):
            asyncio.run(server.guard(keep_asking(server.base_url), poll_s=0.2))
        assert time.monotonic() - started < 10
        assert server.exit_code() == -signal.SIGKILL  # reaped: no zombie left behind
    assert requests_sent >= 1


# ---------------------------------------------------------------- every endpoint down

@pytest.mark.timeout(300)
def test_an_outage_longer_than_the_window_stops_with_one_error_and_the_rerun_is_exactly_once(
        prefect_api, tmp_path, workspace):
    prompts = discover_prompts(workspace, tmp_path, conversations(60, seed=9))
    port = free_port()
    # Slow enough (60 prompts / 4 in flight x 0.3 s = 4.5 s) that the killer below sees 8 committed
    # generations well before the last one: at 0.05 s the whole run could finish between two of its
    # reads (it waits for the writer's lock), and nothing was ever killed (seen in CI).
    proc, url = spawn("--latency", "0.3", port=port, log_path=tmp_path / "server-a.log")
    cfg = regen_config(workspace, [url], write_batch=4)
    cfg = cfg.model_copy(update={"retry": cfg.retry.model_copy(update={
        "probe_interval_s": 0.3, "eject_after_failures": 3, "outage_window_s": 2.0})})
    store = LineageStore(workspace / "lineage.duckdb")
    stopped: list[float] = []

    def stop_server_mid_run() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if store.reports.query_readonly("SELECT count(*) FROM generations")[1][0][0] >= 8:
                break
            time.sleep(0.05)
        proc.kill()
        proc.wait()
        stopped.append(time.monotonic())

    threading.Thread(target=stop_server_mid_run, daemon=True).start()
    try:
        with pytest.raises(EndpointsDown) as err:
            regenerate(cfg)
        took = time.monotonic() - stopped[0]
    finally:
        proc.kill()
    message = str(err.value)
    assert url in message and "connection error" in message and "outage_window_s" in message
    assert took < 2.0 + 10, f"stopped {took:.1f} s after the outage began (window 2 s)"
    _, runs = store.reports.query_readonly("SELECT state FROM runs WHERE flow = 'regenerate'")
    assert runs == [("FAILED",)]
    assert store.reports.query_readonly("SELECT count(*) FROM generation_failures")[1] == [(0,)]
    done_before = len(generated(workspace))
    assert 8 <= done_before < len(prompts)

    proc, _ = spawn("--latency", "0.05", port=port, log_path=tmp_path / "server-b.log")  # the server is back
    try:
        summary = regenerate(cfg)  # the same command, no --retry-failed
    finally:
        proc.kill()
        proc.wait()
    assert summary.generated == len(prompts) - done_before and summary.failed == 0
    gens = generated(workspace)  # asserts no generation was written twice
    assert set(gens) == {pid for pid, _ in prompts}
    for prompt_id, messages in prompts:
        got = [{"role": m["role"], "content": m["content"]} for m in gens[prompt_id]["messages"]]
        assert got == expected_all_mode(messages, 64)


# ---------------------------------------------------------------- the install's own check

def _cc_shared(tmp_path: Path, name: str, source: str, *flags: str) -> Path:
    src = tmp_path / f"{name}.c"
    src.write_text(textwrap.dedent(source))
    lib = tmp_path / f"lib{name}.so"
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", *flags, "-o", str(lib), str(src)], check=True)
    return lib


def test_the_portable_check_finds_avx512_code_and_passes_a_baseline_build(tmp_path):
    source = """
        #include <immintrin.h>
        void add16(float *a, const float *b) {
        #ifdef __AVX512F__
            _mm512_storeu_ps(a, _mm512_add_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b)));
        #else
            for (int i = 0; i < 16; i++) a[i] += b[i];
        #endif
        }
    """
    native = _cc_shared(tmp_path, "avx512", source, "-mavx512f")
    portable = _cc_shared(tmp_path, "baseline", source, "-mavx2", "-mfma", "-mf16c")
    assert non_portable_instructions(native) > 0
    assert non_portable_instructions(portable) == 0
    report = CheckReport()
    check_portable(report, [portable, native])
    assert len(report.failures) == 1 and "libavx512.so" in report.failures[0] and "libbaseline" not in report.failures[0]


@pytest.mark.timeout(180)
def test_check_install_passes_on_this_install(tmp_path):
    out = subprocess.run([EAGLE3, "check-install", "--log", str(tmp_path / "server.log")], cwd=ROOT,
                         capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"^ok +portable: no AVX-512/AMX instructions in \d+ llama.cpp libraries and llama-server", out.stdout, re.M)
    assert re.search(r"^ok +smoke: the embedded server .* answered a greedy request", out.stdout, re.M)


@pytest.mark.timeout(180)
def test_check_install_fails_clearly_when_the_server_cannot_run_on_this_cpu(tmp_path):
    """A server build that dies of SIGILL on its first instruction (a stand-in program in its place)."""
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\necho 'loading model ... (a build for another CPU)'\nulimit -c 0\nkill -ILL $$\n")
    fake.chmod(0o755)
    env = {**os.environ, "EAGLE3_LLAMA_SERVER": str(fake)}
    out = subprocess.run([EAGLE3, "check-install", "--log", str(tmp_path / "server.log")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=170)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "FAIL  smoke" in out.stderr and "signal SIGILL" in out.stderr
    assert "instruction this CPU cannot run" in out.stderr
    assert "a build for another CPU" in out.stderr  # the tail of the server's log


@pytest.mark.timeout(120)
def test_prompts_that_reached_no_server_are_deferred_and_asked_again_without_retry_failed(
        prefect_api, tmp_path, workspace):
    prompts = discover_prompts(workspace, tmp_path, conversations(5, seed=2))
    port = free_port()
    cfg = regen_config(workspace, [f"http://127.0.0.1:{port}"])  # nothing listens yet
    cfg = cfg.model_copy(update={"retry": cfg.retry.model_copy(update={"max_attempts": 2, "eject_after_failures": 1000})})
    summary = regenerate(cfg)
    assert (summary.generated, summary.failed, summary.deferred) == (0, 0, len(prompts))
    store = LineageStore(workspace / "lineage.duckdb")
    _, counts = store.reports.query_readonly("SELECT (SELECT count(*) FROM generation_failures), "
                                     "(SELECT count(DISTINCT prompt_id) FROM generation_deferrals)")
    assert counts == [(0, len(prompts))]
    _, prog = store.reports.query_readonly("SELECT done, pending, failed FROM progress WHERE stage = 'regenerate'")
    assert prog == [(0, len(prompts), 0)]

    proc, _ = spawn(port=port, log_path=tmp_path / "server.log")
    try:
        again = regenerate(cfg)
    finally:
        proc.kill()
        proc.wait()
    assert again.pending_at_start == len(prompts) and again.generated == len(prompts)
    assert set(generated(workspace)) == {pid for pid, _ in prompts}
