"""In-situ timers of the extraction benchmark (benchmarks/extract.py): where an extraction's seconds go.

Owns the timers around the code under test: the hidden-state forward, the non-finite checks, fp8
quantisation, the top-k teacher and its float32 logits, safetensors' save and the shard's sha256. Promises:
nothing is counted twice (a timed call inside another is booked as `inner@outer`), and `remove` puts back
every function it timed.
"""

from __future__ import annotations

import types
from collections import defaultdict

import storage.shards as shards_mod
import tasks.extract.hf_backend as extract_mod
from benchmarks.report import Clock
from tasks.extract.hf_backend import HFExtractor


class Probe:
    """Accumulated wall and CPU seconds inside wrapped functions (module globals and class attributes).

    A wrapped function called inside another wrapped one is booked under `inner@outer` instead of
    its own key, so no second is counted twice (`_nonfinite` also runs on the logits inside `TopkTeacher.fill`).
    """

    def __init__(self) -> None:
        self.t: dict[str, float] = defaultdict(float)
        self._restore: list[tuple[object, str, object]] = []
        self._stack: list[str] = []

    def wrap(self, owner: object, name: str, key: str) -> None:
        orig = getattr(owner, name)
        acc, stack = self.t, self._stack

        def timed(*a, **k):
            book = f"{key}@{stack[-1]}" if stack else key
            stack.append(key)
            clock = Clock()
            try:
                return orig(*a, **k)
            finally:
                w, c = clock.read()
                acc[f"{book}:wall"] += w
                acc[f"{book}:cpu"] += c
                stack.pop()
        setattr(owner, name, timed)
        self._restore.append((owner, name, orig))

    def reset(self) -> None:
        self.t.clear()

    def remove(self) -> None:
        for owner, name, orig in reversed(self._restore):
            setattr(owner, name, orig)
        self._restore.clear()


def install_probe() -> Probe:
    p = Probe()
    p.wrap(HFExtractor, "_forward", "forward_hs")
    p.wrap(extract_mod.TopkTeacher, "fill", "topk")
    p.wrap(extract_mod, "_nonfinite", "nonfinite")
    p.wrap(extract_mod, "quantize_fp8", "fp8")
    p.wrap(shards_mod, "_st_save_file", "save_file")
    p.wrap(shards_mod, "file_sha256", "sha256")
    # `TopkTeacher.fill` calls `F.linear` for its float32 logits; `tasks.extract.hf_backend` gets its own timed copy of
    # torch.nn.functional, so the model's own layers (which call F.linear too) are not timed.
    real_f = extract_mod.F
    proxy = types.ModuleType("torch.nn.functional (timed)")
    proxy.__dict__.update(real_f.__dict__)
    extract_mod.F = proxy
    p._restore.append((extract_mod, "F", real_f))
    p.wrap(proxy, "linear", "logits")
    return p
