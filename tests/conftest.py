"""Test session set-up: one real local Prefect API server for the whole session.

The environment is set at import time, before any test module imports prefect, so every flow in
this process and every CLI subprocess talks to the same server.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from serving.llamacpp.server import free_port  # imports no Prefect: the environment below is set first

ROOT = Path(__file__).resolve().parent.parent


_PREFECT_HOME = Path(tempfile.mkdtemp(prefix="eagle3-prefect-"))
_PORT = free_port()
os.environ["PREFECT_HOME"] = str(_PREFECT_HOME)
os.environ["PREFECT_API_URL"] = f"http://127.0.0.1:{_PORT}/api"
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"


# The fast lane (`make test-fast`, `pytest -m "not slow"`) is every test that starts no server, loads no
# SmolLM2 weights and needs no vLLM. A module made of such tests says `pytestmark = pytest.mark.slow`; a
# test elsewhere is slow when it says so itself or asks for one of these fixtures (the transitive ones count).
SLOW_FIXTURES = frozenset({
    "prefect_api",  # a real Prefect API server (this file)
    "scripted",     # scripted OpenAI-compatible servers as processes (this file, test_online_bench.py)
    # test modules' own fixtures that load SmolLM2's weights (a conversion, or decoding with the model)
    "smol", "smol_bf16", "smol_setup", "smol32", "converted", "float32_target",
})


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def prefect_api() -> str:
    """A real Prefect API server on loopback, started once for the session (about 5 s)."""
    from flows.prefect_api import start_local_api

    url, proc = start_local_api(_PREFECT_HOME, _PORT)
    assert url == os.environ["PREFECT_API_URL"]
    try:
        yield url
        from prefect.logging.handlers import APILogWorker

        APILogWorker.drain_all(timeout=10)  # send the last flow logs before the server goes away
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except Exception:
                proc.kill()


@pytest.fixture(scope="module")
def one_torch_thread():
    """Small matmuls: one torch thread is as fast, and does not stall (10x) when another process
    holds the second core, as parallel test runs do. Restored after the module."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    return ws


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    """A tiny random Llama target folder (fast stage tests), built once per session."""
    from helpers import make_tiny_target

    return make_tiny_target(tmp_path_factory.mktemp("tiny-target"))


@pytest.fixture
def scripted(tmp_path):
    """Start scripted OpenAI-compatible servers as real processes; all are killed at the end."""
    from serving.scripted_server import spawn  # here, not at import: conftest sets the environment first

    procs = []

    def start(*args: str) -> str:
        proc, url = spawn(*args, log_path=tmp_path / f"server-{len(procs)}.log")
        procs.append(proc)
        return url

    yield start
    for p in procs:
        p.kill()
        p.wait()
