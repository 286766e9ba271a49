"""A local Prefect API server: found if one is running, started if not.

Owns how the CLI, the demo and the test session reach a real Prefect API. Promises: one server
per PREFECT_HOME, reused across commands (so the UI shows every run); health-checked before use;
analytics off; concurrency leases kept on disk, so a restart never strands a slot; its log in
`<home>/server.log`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

DEFAULT_PORT = 4200
LEASE_STORAGE = "prefect.server.concurrency.lease_storage.filesystem"


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
        # Concurrency leases on disk (<home>/concurrency_leases), not in the server's memory: a server that
        # restarts then still knows the leases of a stage killed with -9 and frees its slots when they expire.
        # In memory they are lost with the restart and the slots stay taken for ever (every later stage waits).
        "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": LEASE_STORAGE,
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


CHROMIUM_FLAGS = [
    # headless on a machine with no network beyond loopback: no background fetches, no sandbox as root
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]


def chromium_path() -> str:
    import shutil

    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    raise FileNotFoundError("no Chromium on PATH: install it (Debian: apt-get install chromium), "
                            "or open the UI in your own browser")


def render_page(url: str, screenshot: Path | None = None, budget_ms: int = 20000, size: str = "1400,900") -> str:
    """The DOM of `url` after its scripts ran (headless Chromium), and optionally a PNG of it."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="eagle3-chromium-") as profile:
        base = [chromium_path(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--virtual-time-budget={budget_ms}",
                f"--window-size={size}"]
        dom = subprocess.run([*base, "--dump-dom", url], capture_output=True, text=True, timeout=120, check=True).stdout
        if screenshot is not None:
            screenshot.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run([*base, f"--screenshot={screenshot}", url], capture_output=True, timeout=120, check=True)
    return dom


def deployment_ids(api_url: str, name: str) -> dict[str, str]:
    """flow name -> deployment id of every deployment called `name`."""
    r = httpx.post(api_url.rstrip("/") + "/deployments/filter",
                   json={"deployments": {"name": {"any_": [name]}}}, timeout=10)
    r.raise_for_status()
    flows = httpx.post(api_url.rstrip("/") + "/flows/filter",
                       json={"flows": {"id": {"any_": [d["flow_id"] for d in r.json()]}}}, timeout=10).json()
    flow_names = {f["id"]: f["name"] for f in flows}
    return {flow_names[d["flow_id"]]: d["id"] for d in r.json()}


def check_ui(api_url: str, name: str, out_dir: Path) -> dict[str, object]:
    """Drive headless Chromium to the Prefect UI: which of `name`'s deployments the Deployments page
    lists, and whether the pipeline's run form renders its typed parameters. PNGs go to `out_dir`."""
    ui = api_url.rstrip("/").removesuffix("/api")
    ids = deployment_ids(api_url, name)
    dom = render_page(f"{ui}/deployments", out_dir / "deployments.png")
    listed = sorted(flow for flow in ids if f">{flow}<" in dom)
    form_fields: list[str] = []
    if "pipeline" in ids:
        form = render_page(f"{ui}/deployments/deployment/{ids['pipeline']}/run", out_dir / "pipeline-run-form.png",
                           size="1400,1600")
        form_fields = [f for f in ("Workspace", "Discover", "Sources", "Regenerate", "Extract", "Train")
                       if f in form]
    return {"registered": sorted(ids), "listed": listed, "form_fields": form_fields,
            "screenshots": sorted(str(p) for p in out_dir.glob("*.png"))}
