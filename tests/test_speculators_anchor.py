"""The recipe study's anchor (benchmarks/studies/speculators_anchor): our extraction converted to speculators'
data layout with every sample kept and the pre-norm stand-in exact, refusals named, and a speculators
checkpoint imported so our loader computes what it was trained to compute (speculators itself is not
installed here: `make speculators` puts it in its own venv, and the study runs it)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from benchmarks.studies.speculators_anchor.convert import ConvertError, convert
from benchmarks.studies.speculators_anchor.run import AnchorError, ensure_data, import_checkpoint, last_epoch

H, V, EPS = 8, 32, 1e-5
AUX = [1, 2, 3]


def _target(folder: Path) -> torch.Tensor:
    folder.mkdir(parents=True)
    w = torch.linspace(0.5, 1.5, H)
    (folder / "config.json").write_text(json.dumps({"hidden_size": H, "vocab_size": V, "num_hidden_layers": 5,
                                                    "rms_norm_eps": EPS}))
    save_file({"model.norm.weight": w}, str(folder / "model.safetensors"))
    return w


def _vocab(path: Path, ids: list[int], offsets: bool = True) -> Path:
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    d2t = torch.tensor(ids) - (torch.arange(len(ids)) if offsets else 0)
    save_file({"d2t": d2t, "t2d": t2d, "counts": torch.zeros(V, dtype=torch.int64)}, str(path))
    return path


def _shard(path: Path, w: torch.Tensor, lengths: list[int], ids: list[str], seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    x = torch.randn(n, H, generator=g)
    final = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w  # what the target's final norm gives
    t = {"aux_hidden": torch.randn(n, 3 * H, generator=g).bfloat16(), "final_hidden": final.bfloat16(),
         "input_ids": torch.randint(0, V, (n,), generator=g, dtype=torch.int32),
         "loss_mask": (torch.rand(n, generator=g) > 0.3).to(torch.uint8),
         "sample_offsets": torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int64)}
    save_file(t, str(path), metadata={"aux_layer_ids": json.dumps(AUX), "sample_ids": json.dumps(ids),
                                      "teacher": "final_hidden", "format": "eagle3-extract-v1"})
    return t


@pytest.fixture
def extraction(tmp_path):
    w = _target(tmp_path / "target")
    (tmp_path / "shards").mkdir()
    shards = [_shard(tmp_path / "shards" / "k-000002.safetensors", w, [4, 6], ["c", "d"], 2),
              _shard(tmp_path / "shards" / "k-000001.safetensors", w, [5, 3], ["a", "b"], 1)]
    return tmp_path, w, shards[::-1]  # in shard-name order


def test_every_sample_is_converted_in_order_with_the_pre_norm_state_that_gives_back_the_teacher(extraction):
    from datasets import load_from_disk

    root, w, shards = extraction
    vocab = _vocab(root / "vocab.safetensors", [0, 3, 4, 9, 20])
    m = convert(root / "shards", vocab, root / "target", root / "out", "float32")
    assert m["sample_ids"] == ["a", "b", "c", "d"] and m["samples"] == 4 and m["tokens"] == 18
    assert m["loss_masked_tokens"] == sum(int(s["loss_mask"].sum()) for s in shards)
    assert m["speculators_layer_ids"] == [2, 3, 4]
    ds = load_from_disk(str(root / "out"))
    i = 0
    for s in shards:
        off = s["sample_offsets"].tolist()
        for j in range(len(off) - 1):
            a, b = off[j], off[j + 1]
            row = ds[i]
            assert row["input_ids"].tolist() == s["input_ids"][a:b].tolist()
            assert row["loss_mask"].tolist() == s["loss_mask"][a:b].tolist()
            hs = load_file(str(root / "out" / "hidden_states" / f"hs_{i}.safetensors"))
            assert hs["hidden_states"].shape == (b - a, 4, H) and hs["hidden_states"].dtype == torch.float32
            assert hs["token_ids"].dtype == torch.int64 and torch.equal(hs["token_ids"], row["input_ids"])
            assert torch.equal(hs["hidden_states"][:, :3].reshape(b - a, 3 * H), s["aux_hidden"][a:b].float())
            pre = hs["hidden_states"][:, 3]
            teacher = pre * torch.rsqrt(pre.pow(2).mean(-1, keepdim=True) + EPS) * w  # speculators' norm of it
            assert torch.allclose(teacher, s["final_hidden"][a:b].float(), rtol=1e-2, atol=1e-3)
            i += 1
    d2t, t2d = np.load(root / "out" / "d2t-5.npy"), np.load(root / "out" / "t2d-5.npy")
    assert (np.arange(5) + d2t).tolist() == [0, 3, 4, 9, 20] and t2d.sum() == 5


def test_the_conversion_is_reused_only_for_the_same_samples_and_vocab(extraction):
    root, w, _ = extraction
    vocab = _vocab(root / "vocab.safetensors", [0, 3, 4, 9, 20])
    out = ensure_data(root, root / "shards", vocab, root / "target")
    stamp = (out / "manifest.json").stat().st_mtime_ns
    assert ensure_data(root, root / "shards", vocab, root / "target") == out  # reused, not converted again
    assert (out / "manifest.json").stat().st_mtime_ns == stamp
    _shard(root / "shards" / "k-000003.safetensors", w, [2], ["e"], 3)  # the extraction grew
    with pytest.raises(AnchorError, match="sample_ids differ"):
        ensure_data(root, root / "shards", vocab, root / "target")


@pytest.mark.parametrize("breaks, match", [
    ("absolute_vocab", "not offsets onto t2d's ascending target ids"),
    ("duplicate_sample", "sample a appears twice"),
    ("non_finite", "sample c holds non-finite states"),
    ("exists", "exists; give a new folder"),
])
def test_a_conversion_that_would_change_the_data_is_refused_by_name_and_leaves_no_folder(extraction, breaks, match):
    root, w, _ = extraction
    vocab = _vocab(root / "vocab.safetensors", [1, 3, 4], offsets=breaks != "absolute_vocab")
    if breaks == "duplicate_sample":
        _shard(root / "shards" / "k-000003.safetensors", w, [2], ["a"], 3)
    if breaks == "non_finite":
        t = load_file(str(root / "shards" / "k-000002.safetensors"))
        t["aux_hidden"][1, 0] = float("nan")
        save_file(t, str(root / "shards" / "k-000002.safetensors"),
                  metadata={"aux_layer_ids": json.dumps(AUX), "sample_ids": json.dumps(["c", "d"])})
    if breaks == "exists":
        (root / "out").mkdir()
    with pytest.raises(ConvertError, match=match):
        convert(root / "shards", vocab, root / "target", root / "out")
    assert (root / "out").exists() == (breaks == "exists")


def _speculators_save(tmp_path: Path):
    """A draft folder as speculators' own save writes it: its architecture name, no record of ours."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.fixtures import random_draft
    from serving.vllm.export import export_speculators

    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=128, vocab_size=512)).eval()
    draft = random_draft(target, 128, (1, 2, 4), norm_before_fc=True, norm_output=True)
    src = export_speculators(draft, tmp_path / "1", "verifier", dtype=torch.float32, include_embeddings=True)
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"] = ["Eagle3DraftModel"]
    del cfg["eagle3_pipeline"]
    (src / "config.json").write_text(json.dumps(cfg))
    return draft, src


def test_a_speculators_checkpoint_is_imported_so_our_loader_computes_the_same_draft(tmp_path):
    from serving.draft_folder import CheckpointError
    from tasks.export.checkpoint import load_draft

    draft, src = _speculators_save(tmp_path)
    with pytest.raises(CheckpointError):
        load_draft(src)  # as speculators saves it, our loader (and vLLM's reader) do not take it
    embed = draft.embed_tokens.weight.detach()
    with pytest.raises(AnchorError, match="embed_tokens differ from the target's"):
        import_checkpoint(src, tmp_path / "export", [1, 2, 4], 6, embed + 1)
    out = import_checkpoint(src, tmp_path / "export", [1, 2, 4], 6, embed)
    saved, imported = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert "embed_tokens.weight" in saved and set(imported) == set(saved) - {"embed_tokens.weight"}
    assert all(torch.equal(imported[k], saved[k]) for k in imported)  # the draft's weights unchanged
    back = load_draft(out, embed_tokens=draft.embed_tokens.weight)
    assert back.config == draft.config
    g = torch.Generator().manual_seed(3)
    aux, ids = torch.randn(1, 7, 3 * 64, generator=g), torch.randint(0, 512, (1, 7), generator=g)
    with torch.no_grad():
        for a, b in zip(draft(aux, ids, steps=3), back(aux, ids, steps=3)):
            assert torch.equal(a, b)
    with pytest.raises(AnchorError, match=r"layers \[2, 3, 5\], the extraction's are \[1, 2, 3\]"):
        import_checkpoint(src, tmp_path / "other", [1, 2, 3], 6, embed)
    cfg = json.loads((src / "config.json").read_text())
    cfg["norm_before_residual"] = True  # speculators' default: a layer our draft does not compute
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(AnchorError, match="norm_before_residual is True"):
        import_checkpoint(src, tmp_path / "nbr", [1, 2, 4], 6, embed)
    assert not (tmp_path / "nbr").exists()


def test_the_last_epoch_is_the_newest_epoch_end_speculators_linked(tmp_path):
    assert last_epoch(tmp_path) is None
    for n in (0, 1, 10):
        (tmp_path / str(n)).mkdir()
        (tmp_path / f"epoch{n}_end").symlink_to(str(n))
    (tmp_path / "checkpoint_best").symlink_to("1")
    assert last_epoch(tmp_path) == (tmp_path / "10").resolve()
