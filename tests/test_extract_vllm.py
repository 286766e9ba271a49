"""The vllm extraction backend against the hf one, on the embedded target and real ShareGPT chats.

vLLM runs from its own environment (`make vllm`, .venv-vllm; see serving/vllm/extract_server.py for why).
Parity is checked in float32, where both engines must agree to float32 noise, so the stored bf16
states agree to one bf16 rounding step; a layer mapping shifted by one is far outside that.
"""

from __future__ import annotations

import torch
import pytest

from helpers import sharegpt_chats
from serving.vllm.extract_server import VllmHiddenStatesServer, VllmLaunch, vllm_layer_ids
from tasks.extract.hf_backend import ExtractSettings, Extracted, HFExtractor, default_aux_layer_ids
from tasks.extract.vllm_backend import VllmExtractor, load_final_norm_and_head, rms_norm
from tasks.model.target import load_configured_target, load_configured_target_files

pytestmark = pytest.mark.slow  # starts servers, vLLM or `eagle3` processes: not in `make test-fast`

N_SAMPLES = 6
# Stored states are bf16 (8 significant bits): two float32 engines whose sums differ in the last
# bits can round one element to neighbouring bf16 values, one step apart, and a step is at most
# 2^-7 of the value (just above a power of two). Anything larger is not rounding.
BF16_STEP = 2.0 ** -7


def test_vllm_layer_ids_are_ours_plus_one_then_the_last_layer():
    """vLLM captures id j before layer j runs: our "output of layer i" is its i+1; the final state is id L."""
    assert vllm_layer_ids([1, 14, 26], 30) == [2, 15, 27, 30]
    assert vllm_layer_ids([0, 1, 2], 4) == [1, 2, 3, 4]
    with pytest.raises(ValueError):
        vllm_layer_ids([1, 14, 29], 30)  # the last layer's output is post-norm in transformers: refused


@pytest.fixture(scope="module")
def smol32():
    files = load_configured_target_files(None, None, dtype="float32")
    model, tokenizer, _ = load_configured_target(None, None, dtype="float32", device="cpu")
    chats = sharegpt_chats(N_SAMPLES)
    samples = []
    for msgs in chats:
        ids = tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"][:384]
        samples.append((list(ids), [1] * len(ids)))
    return files, model, samples


@pytest.fixture(scope="module")
def vllm_server(smol32, tmp_path_factory):
    files, model, _ = smol32
    aux = default_aux_layer_ids(model.config.num_hidden_layers)
    launch = VllmLaunch(model=files.folder, layer_ids=vllm_layer_ids(aux, model.config.num_hidden_layers),
                        states_dir=tmp_path_factory.mktemp("vllm-states"), dtype="float32", max_model_len=512,
                        max_num_seqs=4)
    with VllmHiddenStatesServer(launch, log_path=tmp_path_factory.mktemp("vllm-log") / "vllm.log") as server:
        yield server


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """Max and mean of |a - b| relative to the token's largest |b| (a bf16 rounding step is <= 2^-7 of it)."""
    a, b = a.float(), b.float()
    rel = (a - b).abs() / b.abs().amax(dim=-1, keepdim=True).clamp_min(1e-6)
    return float(rel.max()), float(rel.mean())


def test_vllm_states_equal_hf_states_and_a_shift_by_one_would_not(smol32, vllm_server):
    files, model, samples = smol32
    aux = default_aux_layer_ids(model.config.num_hidden_layers)
    settings = ExtractSettings(aux_layer_ids=aux)
    norm, eps, _ = load_final_norm_and_head(files.folder, files.config)
    got = VllmExtractor(vllm_server, settings, files.config, norm, eps, concurrency=4).extract(samples)
    want = HFExtractor(model, settings).extract(samples)
    assert all(isinstance(r, Extracted) for r in got + want)
    H = model.config.hidden_size
    worst = []
    for g, w in zip(got, want):
        assert torch.equal(g.input_ids, w.input_ids) and torch.equal(g.loss_mask, w.loss_mask)
        assert g.aux_hidden.dtype == w.aux_hidden.dtype == torch.bfloat16 and g.aux_hidden.shape == w.aux_hidden.shape
        for j in range(3):
            worst.append(_rel_err(g.aux_hidden[:, j * H:(j + 1) * H], w.aux_hidden[:, j * H:(j + 1) * H]))
        worst.append(_rel_err(g.final_hidden, w.final_hidden))
    max_rel, mean_rel = max(m for m, _ in worst), max(m for _, m in worst)
    print(f"\nvllm vs hf, float32 engines, bf16 stored: max rel err {max_rel:.2e}, mean {mean_rel:.2e}")
    # Within one bf16 rounding step everywhere, and almost always identical.
    assert max_rel <= BF16_STEP + 1e-6
    assert mean_rel <= 1e-3

    # The same states against the neighbouring layers (our id i+1, i.e. vLLM's ids off by one):
    # far outside the tolerance, so a mapping off by one cannot pass the check above.
    with torch.inference_mode():
        hs = model.base_model(input_ids=torch.tensor([samples[0][0]]), output_hidden_states=True).hidden_states
    for j, i in enumerate(aux):
        shifted = hs[i + 2][0].to(torch.bfloat16)
        off_max, off_mean = _rel_err(got[0].aux_hidden[:, j * H:(j + 1) * H], shifted)
        assert off_mean > 50 * mean_rel and off_max > 10 * BF16_STEP, (i, off_max, off_mean)


def test_vllm_topk_teacher_equals_hf(smol32, vllm_server):
    files, model, samples = smol32
    V = model.config.vocab_size
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.randperm(V, generator=torch.Generator().manual_seed(8))[:8192]] = True
    settings = ExtractSettings(aux_layer_ids=default_aux_layer_ids(model.config.num_hidden_layers), teacher="topk",
                               topk=20)
    norm, eps, head = load_final_norm_and_head(files.folder, files.config)
    got = VllmExtractor(vllm_server, settings, files.config, norm, eps, head, t2d, concurrency=4).extract(samples)
    want = HFExtractor(model, settings, t2d=t2d).extract(samples)
    positions = top1_same = argmax_same = 0
    lp_err = 0.0
    for g, w in zip(got, want):
        positions += len(g.input_ids)
        top1_same += int((g.topk_ids[:, 0] == w.topk_ids[:, 0]).sum())
        argmax_same += int((g.argmax_in_draft == w.argmax_in_draft).sum())
        lp_err = max(lp_err, float((g.topk_logprobs[:, 0].float() - w.topk_logprobs[:, 0].float()).abs().max()))
    print(f"\ntop-k teacher over {positions} positions: top-1 id equal {top1_same}, argmax bit equal {argmax_same}, "
          f"max top-1 logprob diff {lp_err:.2e}")
    # Near-ties may flip between engines; anything beyond a few in a thousand is a wrong state.
    assert top1_same >= 0.995 * positions and argmax_same >= 0.995 * positions
    assert lp_err <= 0.02


def test_final_norm_is_the_targets(smol32):
    """The post-norm state computed from the last layer's output equals transformers' hidden_states[-1]."""
    files, model, samples = smol32
    norm, eps, _ = load_final_norm_and_head(files.folder, files.config)
    with torch.inference_mode():
        out = model.base_model(input_ids=torch.tensor([samples[0][0]]), output_hidden_states=True)
        layers = model.base_model.layers
        # The last layer's output, before the norm: run the norm's input through a hook.
        seen = {}
        h = model.base_model.norm.register_forward_hook(lambda m, i, o: seen.setdefault("x", i[0]))
        model.base_model(input_ids=torch.tensor([samples[0][0]]))
        h.remove()
    assert len(layers) == model.config.num_hidden_layers
    torch.testing.assert_close(rms_norm(seen["x"][0], norm, eps), out.hidden_states[-1][0], atol=1e-5, rtol=1e-5)


def test_extractor_refuses_a_server_capturing_other_layers(smol32, tmp_path):
    files, model, _ = smol32
    norm, eps, _ = load_final_norm_and_head(files.folder, files.config)
    launch = VllmLaunch(model=files.folder, layer_ids=[1, 14, 26, 30], states_dir=tmp_path)  # ours, not vLLM's
    server = VllmHiddenStatesServer(launch)  # never started: the check comes first
    with pytest.raises(ValueError, match="need vLLM ids"):
        VllmExtractor(server, ExtractSettings(aux_layer_ids=[1, 14, 26]), files.config, norm, eps)


def test_extract_flow_on_the_vllm_backend(prefect_api, tmp_path, workspace, smol32):
    """The extract flow with `backend: vllm` starts its server, fills shards exactly once, and the
    stored states are the target's (a direct float32 forward, within one bf16 rounding step)."""
    from flows.extract import extract
    from storage.lineage import LineageStore
    from storage.shards import ShardStore
    from tasks.extract.hf_backend import aux_hidden_float
    from tasks.extract.plan import read_shard

    from helpers import conversations, extract_config, import_generations
    from test_extract_flow import assert_exactly_once

    _, model, _ = smol32
    assert import_generations(workspace, tmp_path, conversations(10, seed=3)) == 10
    # vLLM's context defaults to max_length + 1: a sample truncated to max_length still gets its one token.
    cfg = extract_config(workspace, None, backend="vllm", vllm={"max_num_seqs": 4})  # max_length 256
    cfg = cfg.model_copy(update={"target": cfg.target.model_copy(update={"dtype": "float32", "device": "cpu"})})
    s = extract(cfg)
    assert (s.extracted, s.quarantined, s.skipped) == (10, 0, 0) and s.stopped_by == "done"
    assert s.truncated_tokens > 0  # every one of these chats is cut to exactly max_length
    assert s.aux_layer_ids == default_aux_layer_ids(model.config.num_hidden_layers)
    store = LineageStore(workspace / "lineage.duckdb")
    assert_exactly_once(workspace, store, 10)
    assert not any((workspace / "vllm-states").iterdir())  # every state file was read and deleted
    assert "extract_hidden_states" in (workspace / "logs" / "vllm-server.log").read_text()

    name, row = next(iter(store.extraction.live_shards().items()))
    records, _, _ = read_shard(ShardStore(workspace / "shards", 1 << 40), name, row["sha256"])
    H = model.config.hidden_size
    for rec in records:
        with torch.inference_mode():
            hs = model.base_model(input_ids=rec.input_ids.long()[None], output_hidden_states=True).hidden_states
        want = torch.cat([hs[i + 1][0] for i in s.aux_layer_ids], dim=-1).bfloat16()
        for j in range(3):
            assert _rel_err(aux_hidden_float(rec)[:, j * H:(j + 1) * H], want[:, j * H:(j + 1) * H])[0] <= BF16_STEP + 1e-6
        assert _rel_err(rec.final_hidden, hs[-1][0].bfloat16())[0] <= BF16_STEP + 1e-6

    again = extract(cfg)  # nothing pending: no server is started
    assert again.pending_at_start == 0 and again.shards_written == 0
