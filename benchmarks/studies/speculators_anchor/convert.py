"""Our extraction (shards + draft vocab) as speculators 0.9.0's offline training data (the project venv).

What speculators reads (speculators/train/data.py `ArrowDataset`, hs_connectors' file transfer, train/cli.py's
vocab mapping) and what this writes:
- OUT/: a `datasets` folder (`save_to_disk`, torch format): input_ids and loss_mask (int64 lists), seq_len, and
  ours: sample_id, shard, row_in_shard. Row i's states are OUT/hidden_states/hs_{i}.safetensors.
- hs_{i}.safetensors: "hidden_states" [T, 4, H]: the three aux layers (our aux_hidden in our aux_layer_ids order),
  then the target's last state BEFORE its final norm; "token_ids" [T] int64, equal to the row's input_ids.
  speculators' teacher is lm_head(final_norm(hs[:, -1])). Our shards keep the post-norm state y = norm(x), so
  the last layer written is y / w (w the final norm's weight): norm(y / w) = y up to eps, since rms(x / rms(x)) = 1.
- OUT/d2t-N.npy (int64 offsets: target id = i + d2t[i], ascending) and OUT/t2d-N.npy (bool [V]): our vocab file
  already holds this convention; anything else is refused.
- OUT/manifest.json: provenance (our sample ids in row order, layer ids both ways, vocab sha256, counts).

Every sample is kept, in shard-name then file order (deterministic). Any mismatch is refused with the shard and
the sample named. The folder is written beside OUT and renamed into place (storage.datasets'
`write_folder_atomically`), so a crash leaves none.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from storage.datasets import file_sha256, write_folder_atomically

SHARD_TENSORS = {"aux_hidden", "final_hidden", "input_ids", "loss_mask", "sample_offsets"}


class ConvertError(ValueError):
    """The extraction cannot become speculators' data as it is (the message names the file and sample)."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConvertError(msg)


def speculators_vocab(path: Path, target_vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """(d2t int64 offsets [N], t2d bool [V]) from our vocab file: speculators selects the head's rows by t2d in
    ascending target id, so draft id i must be the i-th marked target id."""
    v = load_file(str(path))
    _check({"d2t", "t2d"} <= set(v), f"{path}: needs d2t and t2d, has {sorted(v)}")
    d2t, t2d = v["d2t"], v["t2d"]
    _check(d2t.dtype == torch.int64 and d2t.ndim == 1, f"{path}: d2t must be int64 [N], got {d2t.dtype}")
    _check(t2d.dtype == torch.bool and list(t2d.shape) == [target_vocab],
           f"{path}: t2d must be bool [{target_vocab}], got {t2d.dtype} {list(t2d.shape)}")
    ids = torch.nonzero(t2d).squeeze(1)
    _check(ids.numel() == d2t.numel(), f"{path}: t2d marks {ids.numel()} ids, d2t has {d2t.numel()}")
    _check(torch.equal(torch.arange(d2t.numel()) + d2t, ids),
           f"{path}: d2t is not offsets onto t2d's ascending target ids (speculators' convention)")
    return d2t.numpy().astype(np.int64), t2d.numpy().astype(bool)


def target_facts(folder: Path) -> tuple[dict, torch.Tensor]:
    """The target's config and its final norm's weight (float32), from its transformers folder."""
    cfg = json.loads((folder / "config.json").read_text())
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        _check("model.norm.weight" in f.keys(), f"{folder}: no model.norm.weight")
        w = f.get_tensor("model.norm.weight").float()
    _check(list(w.shape) == [cfg["hidden_size"]], f"{folder}: final norm {list(w.shape)}, hidden {cfg['hidden_size']}")
    _check(bool((w.abs() > 1e-3).all()), f"{folder}: the final norm has ~0 weights; final_hidden / w would blow up")
    return cfg, w


def convert(shards: Path, vocab: Path, target: Path, out: Path, hs_dtype: str = "float32",
            limit: int | None = None) -> dict:
    """Write speculators' data folder `out` (module docstring); returns the manifest. An existing `out` is refused:
    the caller decides whether it is the same conversion (`manifest.json`)."""
    from datasets import Dataset

    _check(not out.exists(), f"{out} exists; give a new folder")
    cfg, norm_w = target_facts(target)
    hidden, vocab_size = int(cfg["hidden_size"]), int(cfg["vocab_size"])
    d2t, t2d = speculators_vocab(vocab, vocab_size)
    dtype = getattr(torch, hs_dtype)
    files = sorted(shards.glob("*.safetensors"))
    _check(bool(files), f"no *.safetensors in {shards}")
    manifest: dict = {}

    def write(tmp: Path) -> None:
        (tmp / "hidden_states").mkdir()
        rows: dict[str, list] = {k: [] for k in ("input_ids", "loss_mask", "seq_len", "sample_id", "shard",
                                                 "row_in_shard")}
        aux_ids, worst, i, masked = None, 0.0, 0, 0
        for sf in files:
            with safe_open(str(sf), "pt") as f:
                meta, keys = f.metadata() or {}, set(f.keys())
            _check(SHARD_TENSORS <= keys, f"{sf.name}: missing tensors {sorted(SHARD_TENSORS - keys)}")
            _check(meta.get("teacher", "final_hidden") == "final_hidden", f"{sf.name}: teacher {meta.get('teacher')!r}")
            ids_here = json.loads(meta.get("aux_layer_ids", "null"))
            _check(isinstance(ids_here, list) and len(ids_here) == 3, f"{sf.name}: aux_layer_ids {ids_here}, need 3")
            aux_ids = aux_ids or ids_here
            _check(ids_here == aux_ids, f"{sf.name}: aux_layer_ids {ids_here}, the first shard's {aux_ids}")
            sample_ids = json.loads(meta.get("sample_ids", "null"))
            t = load_file(str(sf))
            n = t["input_ids"].shape[0]
            off = t["sample_offsets"]
            _check(list(t["aux_hidden"].shape) == [n, 3 * hidden] and list(t["final_hidden"].shape) == [n, hidden]
                   and list(t["loss_mask"].shape) == [n], f"{sf.name}: tensor shapes disagree with [{n}] tokens")
            _check(int(off[0]) == 0 and int(off[-1]) == n and bool((off[1:] > off[:-1]).all()),
                   f"{sf.name}: sample_offsets must rise from 0 to {n}")
            _check(isinstance(sample_ids, list) and len(sample_ids) == off.numel() - 1,
                   f"{sf.name}: sample ids do not match its {off.numel() - 1} samples")
            _check(0 <= int(t["input_ids"].min()) and int(t["input_ids"].max()) < vocab_size,
                   f"{sf.name}: token ids outside the target's vocab")
            for j, sid in enumerate(sample_ids):
                if limit is not None and i >= limit:
                    break
                _check(sid not in rows["sample_id"], f"{sf.name}: sample {sid} appears twice in the extraction")
                s, e = int(off[j]), int(off[j + 1])
                aux, final = t["aux_hidden"][s:e].float(), t["final_hidden"][s:e].float()
                _check(bool(torch.isfinite(aux).all() and torch.isfinite(final).all()),
                       f"{sf.name}: sample {sid} holds non-finite states")
                pre = final / norm_w
                # how exactly the stand-in gives back the post-norm state once stored in `hs_dtype`
                back = pre.to(dtype).float()
                back = back * torch.rsqrt(back.pow(2).mean(-1, keepdim=True) + float(cfg["rms_norm_eps"])) * norm_w
                worst = max(worst, float((back - final).abs().max()))
                tokens = t["input_ids"][s:e].to(torch.int64).contiguous()
                hs = torch.cat([aux.view(e - s, 3, hidden), pre.view(e - s, 1, hidden)], dim=1).to(dtype).contiguous()
                save_file({"hidden_states": hs, "token_ids": tokens}, str(tmp / "hidden_states" / f"hs_{i}.safetensors"))
                mask = t["loss_mask"][s:e].to(torch.int64)
                masked += int(mask.sum())
                for k, v in (("input_ids", tokens.tolist()), ("loss_mask", mask.tolist()), ("seq_len", e - s),
                             ("sample_id", sid), ("shard", sf.name), ("row_in_shard", j)):
                    rows[k].append(v)
                i += 1
        _check(i > 0, f"no samples in {shards}")
        ds = Dataset.from_dict(rows)
        ds.set_format(type="torch", columns=["input_ids", "loss_mask", "seq_len"], output_all_columns=True)
        ds.save_to_disk(str(tmp))
        n_draft = len(d2t)
        np.save(tmp / f"d2t-{n_draft}.npy", d2t)
        np.save(tmp / f"t2d-{n_draft}.npy", t2d)
        manifest.update({
            "format": "speculators-0.9.0-offline-data", "samples": i, "tokens": sum(rows["seq_len"]),
            "loss_masked_tokens": masked, "aux_layer_ids": aux_ids,
            "speculators_layer_ids": [k + 1 for k in aux_ids],  # vLLM/speculators count the embeddings as 0
            "hs_dtype": hs_dtype, "prenorm_roundtrip_max_abs_err": worst, "draft_vocab_size": n_draft,
            "vocab_sha256": file_sha256(vocab), "shards": str(shards.resolve()), "target": str(target.resolve()),
            "sample_ids": rows["sample_id"]})
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")

    write_folder_atomically(out, write)
    return manifest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=Path, required=True)
    ap.add_argument("--vocab", type=Path, required=True)
    ap.add_argument("--target", type=Path, required=True, help="the target's transformers folder")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--hs-dtype", choices=["bfloat16", "float32"], default="float32",
                    help="float32 keeps the pre-norm stand-in exact (bfloat16 rounds it once more)")
    ap.add_argument("--limit", type=int, default=None, help="the first N samples only (smoke runs)")
    a = ap.parse_args()
    try:
        m = convert(a.shards, a.vocab, a.target, a.out, a.hs_dtype, a.limit)
    except ConvertError as e:
        raise SystemExit(f"convert: refused: {e}") from None
    print(json.dumps({k: v for k, v in m.items() if k != "sample_ids"}, indent=1))


if __name__ == "__main__":
    main()
