"""Shard planning: the predicted size is the written size, and plans respect the shard target and the room left."""

from __future__ import annotations

import pytest
import torch

from storage.shards import ShardStore
from tasks.extract.hf_backend import ExtractSettings, HFExtractor
from tasks.extract.plan import pack_results, plan_shard, predicted_shard_bytes
from tasks.ids import extract_key, sample_id, tokenize_key


def _tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=6, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=64, vocab_size=300)).eval()


@pytest.mark.parametrize("teacher,storage", [("final_hidden", "bf16"), ("final_hidden", "fp8"), ("topk", "bf16"),
                                             ("topk", "fp8")])
def test_predicted_shard_size_is_the_written_size(tmp_path, teacher, storage):
    model = _tiny()
    settings = ExtractSettings(aux_layer_ids=[1, 2, 4], teacher=teacher, topk=5, storage=storage)
    t2d = torch.zeros(300, dtype=torch.bool)
    t2d[::3] = True
    ex = HFExtractor(model, settings, t2d=t2d if teacher == "topk" else None)
    g = torch.Generator().manual_seed(1)
    lengths = [int(x) for x in torch.randint(3, 90, (7,), generator=g)]
    samples = [(torch.randint(0, 300, (n,), generator=g).tolist(), [0] * (n // 2) + [1] * (n - n // 2)) for n in lengths]
    ekey = extract_key(tokenize_key("t", "r", "tpl", 128, "truncate", None), "vocab", settings)
    sids = [sample_id(f"gen-{i}", ekey) for i in range(len(samples))]
    predicted = predicted_shard_bytes(lengths, sids, ekey, settings, 32)
    tensors, meta, kept = pack_results(ex.extract(samples), sids, ekey, settings)
    assert kept == list(range(7))
    info = ShardStore(tmp_path, predicted).write("s.safetensors", tensors, meta)  # a budget of exactly that fits
    assert info.bytes == predicted


def test_plans_take_the_longest_head_that_fits():
    settings = ExtractSettings(aux_layer_ids=[1, 2, 4])
    lengths = [10, 20, 30, 40, 50]
    sids = [f"{i:032d}" for i in range(5)]

    def size(n: int) -> int:
        return predicted_shard_bytes(lengths[:n], sids[:n], "k", settings, 32)

    assert plan_shard(lengths, sids, "k", settings, 32, shard_bytes=size(3), room_bytes=10**9).count == 3
    assert plan_shard(lengths, sids, "k", settings, 32, shard_bytes=size(3) - 1, room_bytes=10**9).count == 2
    assert plan_shard(lengths, sids, "k", settings, 32, shard_bytes=10**9, room_bytes=size(4)).count == 4
    # a sample bigger than the shard target still gets a shard of its own; one bigger than the room does not
    assert plan_shard(lengths, sids, "k", settings, 32, shard_bytes=1, room_bytes=10**9).count == 1
    nothing = plan_shard(lengths, sids, "k", settings, 32, shard_bytes=10**9, room_bytes=size(1) - 1)
    assert nothing.count == 0 and nothing.predicted_bytes == size(1)
