"""A local Prefect API server: found if one is running, started if not.

Owns how the CLI, the demo and the test session reach a real Prefect API. Promises: one server
per PREFECT_HOME, reused across commands (so the UI shows every run); health-checked before use;
analytics off; its log in `<home>/server.log`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

DEFAULT_PORT = 4200


def api_healthy(api_url: str, timeout_s: float = 2.0) -> bool:
    try:
        return httpx.get(api_url.rstrip("/") + "/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def start_local_api(home: Path, port: int = DEFAULT_PORT, wait_s: float = 120.0) -> tuple[str, subprocess.Popen | None]:
    """The API URL of a local server on `port`, starting one (detached) if none answers there.

    Returns the URL and the process this call started (None when one was already running).
    """
    url = f"http://127.0.0.1:{port}/api"
    if api_healthy(url):
        return url, None
    home.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_API_HOST": "127.0.0.1",
        "PREFECT_SERVER_API_PORT": str(port),
    }
    env.pop("PREFECT_API_URL", None)  # the server itself must not point at another API
    log = open(home / "server.log", "ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
    )
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the Prefect server exited with code {proc.returncode}; see {home / 'server.log'}")
        if api_healthy(url, timeout_s=1.0):
            (home / "server.pid").write_text(str(proc.pid))
            return url, proc
        time.sleep(0.25)
    proc.terminate()
    raise RuntimeError(f"the Prefect server did not answer within {wait_s:.0f} s; see {home / 'server.log'}")


def resolve_api_url() -> str:
    """PREFECT_API_URL when set (it must answer), else a local server under ~/.prefect."""
    url = os.environ.get("PREFECT_API_URL")
    if url:
        if not api_healthy(url):
            raise RuntimeError(f"PREFECT_API_URL={url} does not answer /health; start that server or unset it")
        return url
    home = Path(os.environ.get("PREFECT_HOME", Path.home() / ".prefect"))
    url, _ = start_local_api(home)
    return url
