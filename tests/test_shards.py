"""Tests for storage/shards.py: packing, exact sizes, budget, checksums, crash safety, cleanup."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from storage.datasets import TMP_PREFIX
from storage.shards import (
    OFFSETS_KEY,
    BudgetExceeded,
    CorruptShard,
    ShardInfo,
    ShardStore,
    encoded_size,
    pack_samples,
    unpack_samples,
)

ROOT = Path(__file__).resolve().parent.parent
H = 16


def _bits(t: torch.Tensor) -> torch.Tensor:
    # torch.equal is not implemented for float8 on CPU; compare the raw bytes of every dtype
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _sample(t: int, gen: torch.Generator, fp8: bool = False) -> dict[str, torch.Tensor]:
    s = {
        "input_ids": torch.randint(0, 49152, (t,), dtype=torch.int32, generator=gen),
        "loss_mask": torch.randint(0, 2, (t,), dtype=torch.uint8, generator=gen),
        "final_hidden": torch.randn(t, H, generator=gen).to(torch.bfloat16),
    }
    aux = torch.randn(t, 3 * H, generator=gen)
    if fp8:
        scale = aux.abs().amax(dim=1).clamp(min=1e-6) / 448.0
        s["aux_hidden"] = (aux / scale[:, None]).to(torch.float8_e4m3fn)
        s["aux_scale"] = scale.float()
    else:
        s["aux_hidden"] = aux.to(torch.bfloat16)
    return s


def _batch(lengths: list[int], fp8: bool = False, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return pack_samples([_sample(t, gen, fp8) for t in lengths])


@pytest.mark.parametrize("fp8", [False, True])
def test_pack_unpack_round_trip_is_exact(fp8: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    samples = [_sample(t, gen, fp8) for t in (5, 1, 17, 0, 9)]
    packed = pack_samples(samples)
    assert packed[OFFSETS_KEY].tolist() == [0, 5, 6, 23, 23, 32]
    assert packed[OFFSETS_KEY].dtype == torch.int64
    assert packed["aux_hidden"].dtype == (torch.float8_e4m3fn if fp8 else torch.bfloat16)
    back = unpack_samples(packed)
    assert len(back) == len(samples)
    for orig, got in zip(samples, back):
        assert orig.keys() == got.keys()
        assert all(_same(orig[k], got[k]) for k in orig)


def test_pack_rejects_inconsistent_samples() -> None:
    gen = torch.Generator().manual_seed(2)
    a, b = _sample(4, gen), _sample(4, gen)
    b["loss_mask"] = b["loss_mask"][:3]
    with pytest.raises(ValueError, match="dim-0"):
        pack_samples([a, b])
    c = _sample(4, gen)
    c["input_ids"] = c["input_ids"].long()  # torch.cat would silently promote; we refuse
    with pytest.raises(ValueError, match="dtype"):
        pack_samples([_sample(4, gen), c])
    with pytest.raises(ValueError, match="reserved"):
        pack_samples([{OFFSETS_KEY: torch.zeros(2)}])


def test_write_read_round_trip_with_checksum(tmp_path: Path) -> None:
    store = ShardStore(tmp_path, 10**9)
    tensors = _batch([7, 3, 11], fp8=True)
    meta = {"model": "smollm2-135m", "aux_layers": "2,14,27", "note": 'é "quoted"\n'}
    info = store.write("round-0-000.safetensors", tensors, meta)
    path = tmp_path / info.name
    assert isinstance(info, ShardInfo) and info.bytes == path.stat().st_size
    assert info.sha256 == __import__("hashlib").sha256(path.read_bytes()).hexdigest()
    got, got_meta = store.read(info.name, info.sha256)
    assert got_meta == meta
    assert got.keys() == tensors.keys()
    assert all(_same(tensors[k], got[k]) for k in tensors)
    assert store.names() == [info.name] and store.used_bytes() == info.bytes
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(TMP_PREFIX)]


def test_corrupted_byte_is_detected(tmp_path: Path) -> None:
    store = ShardStore(tmp_path, 10**9)
    info = store.write("s.safetensors", _batch([64, 64]), {})
    path = tmp_path / info.name
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01  # a flipped bit in tensor data: safetensors alone would load it happily
    path.write_bytes(data)
    with pytest.raises(CorruptShard) as e:
        store.read(info.name, info.sha256)
    msg = str(e.value)
    assert str(path) in msg and info.sha256 in msg and e.value.actual in msg
    assert e.value.actual != info.sha256
    # a truncated file is reported as corrupt even without a checksum
    path.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(CorruptShard, match="unreadable"):
        store.read(info.name)


def test_encoded_size_is_exact_for_many_layouts(tmp_path: Path) -> None:
    import safetensors.torch as st

    gen = torch.Generator().manual_seed(3)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32,
              torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8]
    for trial in range(60):
        n = int(torch.randint(1, 7, (1,), generator=gen))
        tensors = {}
        for i in range(n):
            dt = dtypes[int(torch.randint(0, len(dtypes), (1,), generator=gen))]
            shape = torch.randint(0, 40, (int(torch.randint(0, 3, (1,), generator=gen)),), generator=gen).tolist()
            name = "k" * int(torch.randint(1, 4, (1,), generator=gen)) + str(i * 7919 % 13)
            tensors[name] = torch.zeros(shape, dtype=torch.float32).to(dt)
        meta = {"trial": str(trial), "pad": "x" * trial, "ü": "ß\t"} if trial % 2 else None
        assert encoded_size(tensors, meta) == len(st.save(tensors, meta)), (trial, tensors.keys())


def test_budget_is_never_exceeded_and_size_is_exact(tmp_path: Path) -> None:
    one = _batch([50, 30], seed=4)
    size = encoded_size(one, {"i": "0"})
    budget = 3 * size + size // 2  # room for exactly three shards
    store = ShardStore(tmp_path, budget)
    assert store.encoded_size(one, {"i": "0"}) == size
    written = []
    for i in range(10):
        name = f"s{i}.safetensors"
        predicted = store.encoded_size(one, {"i": str(i)})
        try:
            info = store.write(name, one, {"i": str(i)})
        except BudgetExceeded as e:
            msg = str(e)
            assert str(store.used_bytes()) in msg and str(predicted) in msg and str(budget) in msg
            assert not (tmp_path / name).exists()
            break
        assert info.bytes == predicted == (tmp_path / name).stat().st_size
        written.append(info)
        assert store.used_bytes() <= budget
    assert len(written) == 3
    assert store.used_bytes() == sum(i.bytes for i in written) <= budget
    assert sorted(os.listdir(tmp_path)) == [i.name for i in written]  # the refusal wrote nothing
    # deleting frees budget for the next round
    assert store.delete(written[0].name) and not store.delete(written[0].name)
    store.write("s-next.safetensors", one, {"i": "9"})
    assert store.used_bytes() <= budget


def test_overwrite_and_bad_names_are_refused(tmp_path: Path) -> None:
    store = ShardStore(tmp_path, 10**9)
    info = store.write("a.safetensors", _batch([3], seed=5), {"v": "1"})
    with pytest.raises(FileExistsError):
        store.write("a.safetensors", _batch([4], seed=6), {"v": "2"})
    assert store.read("a.safetensors", info.sha256)[1] == {"v": "1"}
    for bad in ("../a.safetensors", "sub/a.safetensors", "a.bin", f"{TMP_PREFIX}x.safetensors"):
        with pytest.raises(ValueError):
            store.write(bad, _batch([1]), {})


def test_failed_rename_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = ShardStore(tmp_path, 10**9)

    def boom(src: object, dst: object) -> None:
        raise OSError("simulated crash at rename")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="simulated"):
        store.write("x.safetensors", _batch([8]), {})
    assert os.listdir(tmp_path) == [] and store.used_bytes() == 0


def test_kill_9_mid_write_leaves_no_visible_shard(tmp_path: Path) -> None:
    # A real process killed with SIGKILL while writing a ~64 MB shard. os.replace is made to
    # hang so the kill lands deterministically before the rename; the kill may hit during the
    # safetensors write, the fsync, the hashing or the hang: in every case the final name
    # must not exist.
    child = textwrap.dedent(f"""
        import os, sys, time, torch
        sys.path.insert(0, {str(ROOT)!r})
        from storage.shards import ShardStore
        os.replace = lambda *a: time.sleep(600)
        t = {{"final_hidden": torch.ones(8192, 4096, dtype=torch.bfloat16)}}
        ShardStore({str(tmp_path)!r}, 10**10).write("big.safetensors", t, {{}})
    """)
    proc = subprocess.Popen([sys.executable, "-c", child])
    try:
        deadline = time.monotonic() + 60
        while not any(p.name.startswith(TMP_PREFIX) for p in tmp_path.iterdir()):
            assert proc.poll() is None, "writer exited before creating its temporary"
            assert time.monotonic() < deadline, "writer never started"
            time.sleep(0.001)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    store = ShardStore(tmp_path, 10**10)
    assert not (tmp_path / "big.safetensors").exists() and store.names() == []
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(TMP_PREFIX)]
    assert len(leftovers) == 1
    assert store.used_bytes() == leftovers[0].stat().st_size  # the temp still occupies disk
    assert store.cleanup(set()) == leftovers
    assert os.listdir(tmp_path) == [] and store.used_bytes() == 0


def test_cleanup_removes_unregistered_and_keeps_registered(tmp_path: Path) -> None:
    store = ShardStore(tmp_path, 10**9)
    kept = store.write("kept.safetensors", _batch([4], seed=7), {})
    store.write("orphan.safetensors", _batch([4], seed=8), {})
    (tmp_path / f"{TMP_PREFIX}dead-x.safetensors").write_bytes(b"partial")
    (tmp_path / "notes.txt").write_text("not a shard")  # foreign files are left alone
    removed = store.cleanup({kept.name})
    assert sorted(p.name for p in removed) == sorted([f"{TMP_PREFIX}dead-x.safetensors", "orphan.safetensors"])
    assert sorted(os.listdir(tmp_path)) == ["kept.safetensors", "notes.txt"]
    assert store.read(kept.name, kept.sha256)[0].keys() >= {"input_ids", OFFSETS_KEY}
    assert store.cleanup({kept.name}) == []
