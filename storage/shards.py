"""The hidden-state shard store of the extract stage.

A shard is one safetensors file holding a packed batch of samples (token-aligned tensors
concatenated along dim 0, with `sample_offsets`) plus string metadata. The store promises:
a shard is visible under its final name only once complete and fsynced; it never writes a
shard that would take the folder past its disk budget; it never overwrites a shard; reads can
verify the sha256 recorded in lineage; nothing is ever unpickled.
"""

from __future__ import annotations

import functools
import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save as _st_save
from safetensors.torch import save_file as _st_save_file

from storage.datasets import TMP_PREFIX, fsync_dir, atomic_path, file_sha256, remove_unregistered

SUFFIX = ".safetensors"
OFFSETS_KEY = "sample_offsets"


class BudgetExceeded(RuntimeError):
    """Writing the shard would take the folder past its disk budget; nothing was written."""

    def __init__(self, name: str, used: int, needed: int, budget: int) -> None:
        super().__init__(
            f"shard {name!r} refused: used {used} B + needed {needed} B = {used + needed} B "
            f"> budget {budget} B"
        )
        self.name, self.used, self.needed, self.budget = name, used, needed, budget


class CorruptShard(RuntimeError):
    """A shard's bytes do not match its recorded sha256, or safetensors cannot parse it."""

    def __init__(self, path: Path, expected: str | None, actual: str | None, reason: str = "") -> None:
        what = reason or "sha256 mismatch"
        super().__init__(f"corrupt shard {path}: {what} (expected {expected}, actual {actual})")
        self.path, self.expected, self.actual = path, expected, actual


@dataclass(frozen=True)
class ShardInfo:
    """What the lineage row needs: file name (relative to the store folder), size and checksum."""

    name: str
    bytes: int
    sha256: str


# ---------------------------------------------------------------- packing


def pack_samples(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Concatenate samples along dim 0 and add `sample_offsets` (int64 [n+1]).

    Every tensor of a sample must have the same dim-0 length (its token count), and every
    sample must have the same keys with the same dtypes and trailing shapes.
    """
    if not samples:
        raise ValueError("pack_samples needs at least one sample")
    keys = sorted(samples[0])
    if OFFSETS_KEY in keys:
        raise ValueError(f"{OFFSETS_KEY!r} is reserved")
    lengths = []
    for i, s in enumerate(samples):
        if sorted(s) != keys:
            raise ValueError(f"sample {i} has keys {sorted(s)}, expected {keys}")
        ls = {k: (s[k].shape[0] if s[k].dim() else -1) for k in keys}
        if len(set(ls.values())) != 1 or -1 in ls.values():
            raise ValueError(f"sample {i}: tensors disagree on dim-0 length (or are scalars): {ls}")
        lengths.append(next(iter(ls.values())))
    packed = {}
    for k in keys:
        parts = [s[k] for s in samples]
        dtypes = {p.dtype for p in parts}
        if len(dtypes) != 1:
            raise ValueError(f"{k!r}: samples disagree on dtype: {dtypes}")
        packed[k] = torch.cat(parts)  # also checks trailing shapes agree
    offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    packed[OFFSETS_KEY] = offsets
    return packed


def unpack_samples(tensors: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Inverse of pack_samples. Returned tensors are views into the packed ones (no copy)."""
    offsets = tensors[OFFSETS_KEY]
    if offsets.dtype != torch.int64 or offsets.dim() != 1 or len(offsets) < 2 or int(offsets[0]) != 0:
        raise ValueError(f"bad {OFFSETS_KEY}: {offsets}")
    bounds = offsets.tolist()
    if any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"{OFFSETS_KEY} not monotonic")
    fields = {k: v for k, v in tensors.items() if k != OFFSETS_KEY}
    for k, v in fields.items():
        if v.dim() == 0 or v.shape[0] != bounds[-1]:
            raise ValueError(f"{k!r} has {tuple(v.shape)}, offsets end at {bounds[-1]}")
    return [{k: v[a:b] for k, v in fields.items()} for a, b in zip(bounds, bounds[1:])]


# ---------------------------------------------------------------- exact encoded size


@functools.cache
def _dtype_table() -> dict[torch.dtype, tuple[str, int]]:
    """torch dtype -> (safetensors dtype name, rank in safetensors' data-layout sort).

    safetensors lays tensors out sorted by dtype (descending) then name; the order changes
    the offsets' digit counts and so the header length. Probe the installed version instead
    of hard-coding its enum order.
    """
    names = {}
    for dt in (getattr(torch, n, None) for n in (
        "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8",
        "uint64", "uint32", "uint16", "uint8", "bool", "complex64", "float8_e4m3fn",
        "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
    )):
        if dt is None:
            continue
        try:
            names[dt] = _read_header(_st_save({"x": torch.zeros(1, dtype=dt)}))["x"]["dtype"]
        except Exception:  # this safetensors/torch pair cannot store it; it is then unsupported
            continue
    dts = list(names)
    header = _read_header(_st_save({f"t{i}": torch.zeros(1, dtype=dt) for i, dt in enumerate(dts)}))
    layout = sorted(range(len(dts)), key=lambda i: header[f"t{i}"]["data_offsets"][0])
    # first in the layout gets the highest rank, so sorting by (-rank, name) reproduces it
    return {dts[i]: (names[dts[i]], len(dts) - pos) for pos, i in enumerate(layout)}


def _read_header(data: bytes) -> dict:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n])


def encoded_size(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> int:
    """Exact size in bytes of the safetensors file for (tensors, metadata), without serialising."""
    table = _dtype_table()
    for k, v in tensors.items():
        if v.dtype not in table:
            raise TypeError(f"{k!r}: dtype {v.dtype} not storable by safetensors")
    order = sorted(tensors, key=lambda k: (-table[tensors[k].dtype][1], k))
    header: dict = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    pos = 0
    for k in order:
        v = tensors[k]
        n = v.numel() * v.element_size()
        header[k] = {"dtype": table[v.dtype][0], "shape": list(v.shape), "data_offsets": [pos, pos + n]}
        pos += n
    # serde_json compact output, UTF-8 unescaped; safetensors pads the header to 8 bytes
    hlen = len(json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode())
    return 8 + (hlen + 7) // 8 * 8 + pos


# ---------------------------------------------------------------- the store


class ShardStore:
    """Shards in one folder under a disk budget. The budget check and the no-overwrite check are
    not safe against a concurrent writer: several processes may write into one folder only when
    one planner gives each write a distinct name and reserves its bytes against the budget first
    (the extract flow with workers does)."""

    def __init__(self, folder: Path, disk_budget_bytes: int) -> None:
        self.folder = Path(folder)
        self.budget = int(disk_budget_bytes)
        self.folder.mkdir(parents=True, exist_ok=True)

    def _path(self, name: str) -> Path:
        if not name.endswith(SUFFIX) or name != Path(name).name or name.startswith("."):
            raise ValueError(f"bad shard name {name!r}: want a plain file name ending in {SUFFIX}")
        return self.folder / name

    def names(self) -> list[str]:
        return sorted(
            p.name for p in self.folder.iterdir()
            if p.is_file() and p.suffix == SUFFIX and not p.name.startswith(TMP_PREFIX)
        )

    def used_bytes(self) -> int:
        """Bytes of shard files, plus any leftover temporaries: they occupy the same disk until
        cleanup() removes them, so counting them keeps the budget honest after a crash."""
        return sum(
            p.stat().st_size for p in self.folder.iterdir()
            if p.is_file() and (p.suffix == SUFFIX or p.name.startswith(TMP_PREFIX))
        )

    def encoded_size(self, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> int:
        return encoded_size(tensors, _meta(metadata))

    def write(self, name: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> ShardInfo:
        final = self._path(name)
        if final.exists():
            raise FileExistsError(f"shard {final} already exists; shards are never overwritten")
        meta = _meta(metadata)
        tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        needed = encoded_size(tensors, meta)
        used = self.used_bytes()
        if used + needed > self.budget:
            raise BudgetExceeded(name, used, needed, self.budget)
        with atomic_path(final) as tmp:
            _st_save_file(tensors, tmp, metadata=meta)
            size = tmp.stat().st_size
            if size != needed:  # the budget decision was made on `needed`; never trust it silently
                raise RuntimeError(f"encoded_size predicted {needed} B but safetensors wrote {size} B")
            digest = file_sha256(tmp)
        return ShardInfo(name, size, digest)

    def read(self, name: str, sha256: str | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        path = self._path(name)
        if sha256 is not None:
            actual = file_sha256(path)
            if actual != sha256:
                raise CorruptShard(path, sha256, actual)
        try:
            with safe_open(path, framework="pt") as f:
                metadata = dict(f.metadata() or {})
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except FileNotFoundError:
            raise
        except Exception as e:  # safetensors raises its own error type for unparsable files
            raise CorruptShard(path, sha256, None, f"unreadable: {e}") from e
        return tensors, metadata

    def delete(self, name: str) -> bool:
        """Remove a shard; False if it was already gone (so a resumed round can repeat it)."""
        path = self._path(name)
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        fsync_dir(self.folder)
        return True

    def cleanup(self, registered: set[str]) -> list[Path]:
        """Remove temporaries and shards the lineage store does not know (a crash between
        write() and the lineage commit left them)."""
        return remove_unregistered(self.folder, registered, suffix=SUFFIX)


def _meta(metadata: dict[str, str] | None) -> dict[str, str]:
    meta = dict(metadata or {})
    for k, v in meta.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"metadata must be dict[str, str], got {k!r}: {type(v).__name__}")
    return meta
