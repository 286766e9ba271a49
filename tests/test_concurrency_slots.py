"""Prefect concurrency slots never strand a pipeline: a stage killed with -9 while its Prefect server
restarts gets its slots back when the lease expires, and a stage that waits says why and how to free them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from serving.llamacpp.server import free_port

HOLD_SLOT = """
import sys, time
from prefect.concurrency.sync import concurrency
with concurrency(sys.argv[1], occupy=1, lease_duration=60, strict=True):
    print("held", flush=True)
    time.sleep(600)
"""


def _active_slots(api_url: str, name: str) -> int:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.pipeline import slots_in_use

    with temporary_settings({PREFECT_API_URL: api_url}):
        return slots_in_use(name)[0]


@pytest.mark.slow  # starts a server: not in `make test-fast`
def test_a_slot_held_by_a_killed_stage_frees_after_the_server_restarts(tmp_path: Path, monkeypatch):
    """The lease outlives the server's restart (kept on disk), so the server frees the dead holder's slot.
    With leases in the server's memory (Prefect's default) the slot stayed taken for ever, and every later
    pipeline waited without an error."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.prefect_api import start_local_api

    home, port, name = tmp_path / "prefect", free_port(), "test-gpus"
    monkeypatch.setenv("PREFECT_SERVER_SERVICES_REPOSSESSOR_LOOP_SECONDS", "2")  # read by the server started below
    server = None
    try:
        url, server = start_local_api(home, port)
        assert server is not None
        with temporary_settings({PREFECT_API_URL: url}), get_client(sync_client=True) as client:
            client.upsert_global_concurrency_limit_by_name(name, 1)
        holder = subprocess.Popen([sys.executable, "-c", HOLD_SLOT, name], stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, "PREFECT_API_URL": url, "PREFECT_HOME": str(home)})
        try:
            assert holder.stdout.readline().strip() == "held"
        finally:
            holder.send_signal(signal.SIGKILL)
            holder.wait()
        server.terminate()
        server.wait(timeout=30)
        assert list((home / "concurrency_leases").glob("*.json")), "the lease was not kept on disk"

        url, server = start_local_api(home, port)
        assert server is not None
        assert _active_slots(url, name) == 1  # the dead holder's slot survives the restart...
        deadline = time.monotonic() + 150  # ...until its 60 s lease expires and the repossessor frees it
        while _active_slots(url, name) and time.monotonic() < deadline:
            time.sleep(2)
        assert _active_slots(url, name) == 0, "the killed holder's slot was never freed"
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)


def test_a_stage_waiting_for_slots_names_the_limit_and_the_cure(prefect_api, monkeypatch):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitUpdate

    from flows import pipeline
    from tasks.config import ResourcesConfig

    name = "test-orphaned"
    with get_client(sync_client=True) as client:
        client.upsert_global_concurrency_limit_by_name(name, 1)
        # what a server restart leaves behind: a slot counted as taken that no lease will ever free
        client.update_global_concurrency_limit(name, GlobalConcurrencyLimitUpdate(active_slots=1))
    warnings: list[str] = []
    monkeypatch.setattr(pipeline, "WAIT_WARNING_SECONDS", 1.0)
    monkeypatch.setattr(pipeline, "_logger", lambda: SimpleNamespace(warning=warnings.append))
    with pytest.raises(TimeoutError) as raised:
        with pipeline.held(name, 1, {name: 1}, ResourcesConfig(wait_seconds=3)):
            pytest.fail("the slot is taken: the block must not run")
    cure = f"prefect gcl update {name} --active-slots 0"
    assert "1 of 1 in use" in str(raised.value) and cure in str(raised.value)
    assert warnings and all(cure in w for w in warnings)  # said while waiting, not only at the end

    with get_client(sync_client=True) as client:  # the cure works: the stage runs
        client.update_global_concurrency_limit(name, GlobalConcurrencyLimitUpdate(active_slots=0))
    ran = []
    with pipeline.held(name, 1, {name: 1}, ResourcesConfig(wait_seconds=30)):
        ran.append(_active_slots(prefect_api, name))
    assert ran == [1] and _active_slots(prefect_api, name) == 0
