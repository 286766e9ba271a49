"""Draft export: engine layer-id rules, SGLang's loader semantics, round trips in both formats, and a
refusal on load for each silent failure of docs/contracts.md (2 layers.0 keys, 3 eagle_config, 4 layer
ids, 5 d2t, 6 fc / lm_head), in the serving contract's words (serving/contract.py, the doctor's)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tasks.model.draft import DraftConfig, Eagle3Draft, load_target_embeddings
from serving.draft_folder import CheckpointError
from serving.sglang.export import check_sglang, export_sglang, load_sglang
from serving.sglang.layers import sglang_capture_layers, sglang_layer_ids
from serving.sglang.loader import sglang_load_report
from serving.vllm.export import export_speculators, load_speculators
from serving.vllm.layers import vllm_capture_layers, vllm_layer_ids
from tasks.export.checkpoint import load_draft

from helpers import edit_export

V, H, N_DRAFT, LAYERS, AUX = 512, 64, 128, 30, (1, 14, 26)
VERIFIER = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _config(aux=AUX, **overrides) -> DraftConfig:
    return DraftConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                       rms_norm_eps=1e-5, rope_theta=100000.0, rope_scaling=None, max_position_embeddings=2048,
                       hidden_act="silu", target_vocab_size=V, draft_vocab_size=N_DRAFT, aux_layer_ids=aux,
                       target_num_layers=LAYERS, **overrides)


def _draft(config: DraftConfig | None = None, seed: int = 0) -> Eagle3Draft:
    torch.manual_seed(seed)
    draft = Eagle3Draft(config or _config())
    with torch.no_grad():  # norms away from 1 so a swapped or dropped norm shows in the logits
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:N_DRAFT].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    draft.set_vocab(ids - torch.arange(N_DRAFT), t2d)
    load_target_embeddings(draft, torch.randn(V, H))
    return draft


def _inputs(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 11, 3 * H, generator=g), torch.randint(0, V, (2, 11), generator=g)


@pytest.fixture(scope="module")
def draft() -> Eagle3Draft:
    return _draft()


@pytest.fixture
def sglang_folder(draft, tmp_path) -> Path:
    return export_sglang(draft, tmp_path / "sglang", dtype=torch.float32)


_edit = edit_export  # one helper for every test that breaks an export


def _refused(folder: Path, match: str, loader=load_sglang, **kwargs) -> CheckpointError:
    with pytest.raises(CheckpointError, match=match) as info:
        loader(folder, **kwargs)
    return info.value


# ---- layer ids --------------------------------------------------------------------------------------

def test_sglang_capture_rule_before_and_since_pr25454():
    # docs/contracts.md: [1, 29, 57] captures the same layers in both versions; [2, 30, 58] only since.
    for version in ("before-pr25454", "since-pr25454"):
        assert sglang_capture_layers([1, 29, 57], 61, version) == [1, 29, 57]
    assert sglang_capture_layers([2, 30, 58], 61, "since-pr25454") == [1, 29, 57]
    assert sglang_capture_layers([2, 30, 58], 61, "before-pr25454") == [2, 30, 58]
    assert sglang_capture_layers([0, 5, 60], 61, "since-pr25454") == [None, 4, 59]  # 0: the embeddings
    assert sglang_capture_layers([1, 5, 60], 61, "before-pr25454") == [1, 5, None]  # past the last layer
    with pytest.raises(ValueError, match="unknown SGLang version"):
        sglang_capture_layers([1, 2, 3], 61, "v0.5")


def test_sglang_layer_ids_serve_both_versions_or_refuse():
    assert sglang_layer_ids([1, 14, 26], 30) == [1, 14, 26]
    with pytest.raises(ValueError, match="PR #25454"):
        sglang_layer_ids([2, 14, 26], 30)
    for version in ("before-pr25454", "since-pr25454"):
        written = sglang_layer_ids([2, 14, 26], 30, version)
        assert sglang_capture_layers(written, 30, version) == [2, 14, 26]
    assert sglang_layer_ids([2, 14, 26], 30, "since-pr25454") == [3, 15, 27]
    assert sglang_layer_ids([0, 14, 26], 30, "before-pr25454") == [0, 14, 26]
    with pytest.raises(ValueError, match="cannot capture"):
        sglang_layer_ids([0, 14, 26], 30, "since-pr25454")


def test_vllm_layer_ids_are_captured_before_layer_j():
    assert vllm_layer_ids([1, 14, 26]) == [2, 15, 27]
    assert vllm_capture_layers(vllm_layer_ids([0, 14, 28]), 30) == [0, 14, 28]


# ---- SGLang format --------------------------------------------------------------------------------

def test_sglang_config_and_keys(sglang_folder):
    cfg = json.loads((sglang_folder / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 14, 26], "use_aux_hidden_state": True}
    assert "eagle_aux_hidden_state_layer_ids" not in cfg  # SGLang ignores it at top level: do not suggest otherwise
    assert (cfg["draft_vocab_size"], cfg["vocab_size"], cfg["hidden_size"]) == (N_DRAFT, V, H)
    assert cfg["tie_word_embeddings"] is False and cfg["num_hidden_layers"] == 1
    keys = set(load_file(str(sglang_folder / "model.safetensors")))
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.hidden_norm.weight",
            "midlayer.self_attn.q_proj.weight", "midlayer.mlp.gate_proj.weight"} <= keys
    assert not any(k.startswith(("layers.", "draft_model.", "embed_tokens")) for k in keys)
    assert not list(sglang_folder.glob("*.bin"))


def test_sglang_loader_consumes_every_key_and_builds_hot_token_id(draft, sglang_folder):
    tensors = load_file(str(sglang_folder / "model.safetensors"))
    cfg = json.loads((sglang_folder / "config.json").read_text())
    report = sglang_load_report(tensors, cfg, tensors["d2t"])
    assert report.skipped == [] and report.shape_errors == []
    assert report.unloaded == ["model.embed_tokens.weight"]  # the server copies the target's
    assert report.silent_problems == []
    assert report.loaded["midlayer.self_attn.k_proj.weight"] == ("model.midlayer.self_attn.qkv_proj.weight", "k")
    assert report.loaded["midlayer.mlp.up_proj.weight"] == ("model.midlayer.mlp.gate_up_proj.weight", 1)
    assert report.loaded["lm_head.weight"] == ("lm_head.weight", None)
    assert report.loaded["fc.weight"] == ("model.fc.weight", None)
    assert torch.equal(report.hot_token_id, draft.draft_to_target)
    # The same loader with layers.0.* keys drops the decoder layer and says nothing: we say it.
    renamed = {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}
    bad = sglang_load_report(renamed, cfg, tensors["d2t"])
    assert len(bad.skipped) == 10 and all(k.startswith("layers.0.") for k in bad.skipped)
    assert "model.midlayer.self_attn.qkv_proj.weight (shard q)" in bad.unloaded
    # With tied embeddings SGLang has no lm_head parameter of its own: our lm_head.weight is skipped.
    tied = sglang_load_report(tensors, {**cfg, "tie_word_embeddings": True})
    assert tied.skipped == ["lm_head.weight"]


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _sglang_chain(folder: Path, embed: torch.Tensor, aux: torch.Tensor, ids: torch.Tensor, s: int,
                  steps: int) -> list[torch.Tensor]:
    """Draft logits SGLang computes from position s, steps 0..steps-1, written from its source.

    llama_eagle3.py as served: the weights as its loader stacks them (qkv_proj, gate_up_proj); draft
    extend over positions 0..s with inputs (fc(aux_p), embed(token p+1)) at rope position p, causal;
    then decode steps feeding the pre-norm hidden (`hidden_states_to_aux`) back at position s+i,
    attending to every cached key. Tokens fed are the sample's own (as TTT feeds them).
    """
    cfg = json.loads((folder / "config.json").read_text())
    w = load_file(str(folder / "model.safetensors"))
    report = sglang_load_report(w, cfg, w["d2t"])
    stacked: dict[str, dict] = {}
    for key, (param, shard) in report.loaded.items():
        stacked.setdefault(param, {})[shard] = w[key]
    p = {name: (torch.cat([parts[k] for k in ("q", "k", "v")]) if "qkv" in name else
                torch.cat([parts[0], parts[1]]) if "gate_up" in name else parts[None])
         for name, parts in stacked.items() if name not in ("hot_token_id", "(ignored by SGLang)")}
    nh, kvh, hd, eps = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["rms_norm_eps"]
    m = "model.midlayer."
    inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd))

    def rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:  # x [n, heads, hd], neox style
        f = pos[:, None].float() * inv[None]
        cos, sin = torch.cat([f, f], -1).cos()[:, None], torch.cat([f, f], -1).sin()[:, None]
        a, b = x.chunk(2, -1)
        return x * cos + torch.cat([-b, a], -1) * sin

    keys, values = [], []

    def layer(embeds: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor, causal: bool) -> torch.Tensor:
        residual = hidden
        x = torch.cat([_rms(embeds, p[m + "input_layernorm.weight"], eps),
                       _rms(hidden, p[m + "hidden_norm.weight"], eps)], -1)
        q, k, v = (x @ p[m + "self_attn.qkv_proj.weight"].T).split([nh * hd, kvh * hd, kvh * hd], -1)
        q, k, v = rope(q.view(-1, nh, hd), pos), rope(k.view(-1, kvh, hd), pos), v.view(-1, kvh, hd)
        keys.append(k), values.append(v)
        kk, vv = torch.cat(keys).repeat_interleave(nh // kvh, 1), torch.cat(values).repeat_interleave(nh // kvh, 1)
        scores = torch.einsum("qhd,khd->hqk", q, kk) / hd ** 0.5
        if causal:
            scores = scores.masked_fill(~torch.ones(len(q), len(kk), dtype=torch.bool).tril(), float("-inf"))
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv).reshape(len(q), nh * hd)
        h1 = out @ p[m + "self_attn.o_proj.weight"].T + residual  # fused add + norm: (norm(h + r), h + r)
        normed = _rms(h1, p[m + "post_attention_layernorm.weight"], eps)
        gate, up = (normed @ p[m + "mlp.gate_up_proj.weight"].T).chunk(2, -1)
        return torch.nn.functional.silu(gate) * up @ p[m + "mlp.down_proj.weight"].T + h1

    def propose(hidden: torch.Tensor) -> torch.Tensor:  # draft-vocab logits of the last position
        return (_rms(hidden, p["model.norm.weight"], eps) @ p["lm_head.weight"].T)[-1]

    hidden = layer(embed[ids[1:s + 2]], aux[:s + 1] @ p["model.fc.weight"].T, torch.arange(s + 1), causal=True)[-1:]
    out = [propose(hidden)]
    for i in range(1, steps):
        hidden = layer(embed[ids[s + i + 1:s + i + 2]], hidden, torch.tensor([s + i]), causal=False)
        out.append(propose(hidden))
    return out


def test_ttt_steps_propose_what_sglang_serves(draft, sglang_folder):
    aux, ids = _inputs(5)
    with torch.no_grad():
        logits = draft(aux, ids, steps=3)
        hot = sglang_load_report(load_file(str(sglang_folder / "model.safetensors")),
                                 json.loads((sglang_folder / "config.json").read_text()),
                                 load_file(str(sglang_folder / "model.safetensors"))["d2t"]).hot_token_id
        for s in (0, 4, 7):
            served = _sglang_chain(sglang_folder, draft.embed_tokens.weight, aux[0], ids[0], s, 3)
            for step, (ours, theirs) in enumerate(zip(logits, served)):
                torch.testing.assert_close(ours[0, s], theirs, rtol=1e-4, atol=1e-4, msg=f"position {s} step {step}")
                # and the token proposed is the same target id
                assert hot[theirs.argmax()] == draft.draft_to_target[ours[0, s].argmax()]


def test_sglang_round_trip_gives_identical_logits(draft, tmp_path):
    aux, ids = _inputs()
    embed = draft.embed_tokens.weight
    folder = export_sglang(draft, tmp_path / "fp32", dtype=torch.float32)
    back = load_sglang(folder, embed_tokens=embed)
    assert back.config == draft.config
    with torch.no_grad():
        for a, b in zip(draft(aux, ids, steps=3), back(aux, ids, steps=3)):
            assert torch.equal(a, b)
    # bf16 (the default) round-trips exactly to the bf16-rounded draft.
    folder = export_sglang(draft, tmp_path / "bf16", include_embeddings=True)
    assert load_file(str(folder / "model.safetensors"))["fc.weight"].dtype == torch.bfloat16
    rounded = _draft()
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    back = load_sglang(folder)  # embeddings from the file this time
    with torch.no_grad():
        for a, b in zip(rounded(aux, ids, steps=2), back(aux, ids, steps=2)):
            assert torch.equal(a, b)
    with pytest.raises(FileExistsError):
        export_sglang(draft, folder)


def test_sglang_export_for_one_version_when_both_cannot_be_served(tmp_path):
    d = _draft(_config(aux=(2, 14, 26)))
    with pytest.raises(ValueError, match="PR #25454"):
        export_sglang(d, tmp_path / "any")
    assert not (tmp_path / "any").exists()
    folder = export_sglang(d, tmp_path / "since", sglang_version="since-pr25454")
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [3, 15, 27]
    assert load_sglang(folder).config.aux_layer_ids == (2, 14, 26)
    # Served by the other version, the same file captures other layers: refused when that version is named.
    _refused(folder, r"before-pr25454 capture\(s\) layers \[3, 15, 27\]", sglang_version="before-pr25454")


# ---- the silent failures, each refused on load ---------------------------------------------------------

def test_refuses_layers0_keys_failure_2(sglang_folder):
    _edit(sglang_folder, tensors=lambda t: [t.__setitem__(k.replace("midlayer.", "layers.0."), t.pop(k))
                                            for k in list(t) if k.startswith("midlayer.")])
    err = _refused(sglang_folder, r"layers\.0\.\* .*midlayer")
    assert len(err.problems) == 1  # the cause, not ten consequences


def test_refuses_draft_model_prefix(sglang_folder):
    _edit(sglang_folder, tensors=lambda t: [t.__setitem__("draft_model." + k, t.pop(k)) for k in list(t)
                                            if k not in ("d2t", "t2d")])
    _refused(sglang_folder, "draft_model. prefix")


@pytest.mark.parametrize("edit, match", [
    (lambda c: c.pop("eagle_config"), r"eagle_config \(with eagle_aux_hidden_state_layer_ids\) is missing"),
    (lambda c: c.update(eagle_aux_hidden_state_layer_ids=c.pop("eagle_config")["eagle_aux_hidden_state_layer_ids"]),
     "only at the top level .*which SGLang ignores"),
    (lambda c: c["eagle_config"].update(use_aux_hidden_state=False), "use_aux_hidden_state"),
])
def test_refuses_missing_eagle_config_failure_3(sglang_folder, edit, match):
    _refused(_edit(sglang_folder, config=edit), match)


def test_refuses_layer_ids_off_by_one_failure_4(sglang_folder, draft):
    # Ids written in SGLang's "captured before layer j" spelling: since PR #25454 that captures
    # the trained layers, before it the next ones.
    _edit(sglang_folder, config=lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[2, 15, 27]))
    err = _refused(sglang_folder, r"before-pr25454 capture\(s\) layers \[2, 15, 27\] but the draft was trained on "
                                  r"\[1, 14, 26\]")
    assert not any("since-pr25454" in p for p in err.problems)
    # Without our record, the caller's expectation is what the ids are checked against.
    _edit(sglang_folder, config=lambda c: c.pop("eagle3_pipeline"))
    _refused(sglang_folder, r"capture\(s\) layers", expected_aux_layer_ids=[1, 14, 26], target_num_layers=LAYERS)
    # Served only by SGLang since PR #25454 (named), the same file reads the trained layers.
    assert check_sglang(sglang_folder, expected_aux_layer_ids=[1, 14, 26], target_num_layers=LAYERS,
                        sglang_version="since-pr25454") == []


def test_refuses_layer_ids_other_than_expected(sglang_folder):
    _refused(sglang_folder, r"record says the draft was trained on layers \[1, 14, 26\], lineage / the caller says "
                            r"\[1, 13, 26\]", expected_aux_layer_ids=[1, 13, 26])


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.__setitem__("d2t", t["d2t"] + torch.arange(N_DRAFT)), "absolute target ids"),
    (lambda t: t.pop("d2t"), "d2t is missing"),
    (lambda t: t.__setitem__("d2t", t["d2t"].int()), "int64"),
    (lambda t: t.__setitem__("t2d", torch.roll(t["t2d"], 1)), "t2d"),
])
def test_refuses_bad_d2t_failure_5(sglang_folder, edit, match):
    _refused(_edit(sglang_folder, tensors=edit), match)


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.__setitem__("fc.weight", t["fc.weight"][:, : 2 * H].contiguous()), r"fc.weight .*3 x target hidden"),
    (lambda t: t.pop("fc.weight"), "fc.weight is missing"),
    (lambda t: t.pop("lm_head.weight"), "lm_head.weight is missing"),
    (lambda t: t.__setitem__("lm_head.weight", torch.zeros(N_DRAFT + 1, H)), f"lm_head.weight has {N_DRAFT + 1} rows"),
    (lambda t: t.__setitem__("midlayer.self_attn.q_proj.weight", torch.zeros(64, H)), r"2 x hidden"),
])
def test_refuses_bad_fc_or_lm_head_failure_6(sglang_folder, edit, match):
    _refused(_edit(sglang_folder, tensors=edit), match)


@pytest.mark.parametrize("edit, match", [
    (lambda c: c.update(tie_word_embeddings=True), "tie_word_embeddings"),
    (lambda c: c.pop("draft_vocab_size"), "draft_vocab_size"),
    (lambda c: c.update(architectures=["LlamaForCausalLM"]), "architectures"),
    (lambda c: c.update(num_hidden_layers=2), "num_hidden_layers"),
])
def test_refuses_config_sglang_would_misread(sglang_folder, edit, match):
    _refused(_edit(sglang_folder, config=edit), match)


def test_never_loads_pickle(sglang_folder):
    (sglang_folder / "model.safetensors").rename(sglang_folder / "pytorch_model.bin")
    _refused(sglang_folder, "pickle checkpoints are never loaded")


# ---- speculators / vLLM format -------------------------------------------------------------------------

def test_speculators_format_and_round_trip(draft, tmp_path):
    folder = export_speculators(draft, tmp_path / "spec", VERIFIER, speculative_tokens=4, dtype=torch.float32)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3Speculator"] and cfg["speculators_model_type"] == "eagle3"
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]  # vLLM: captured before layer j
    assert cfg["norm_before_residual"] is False
    assert cfg["transformer_layer_config"]["vocab_size"] == V and cfg["draft_vocab_size"] == N_DRAFT
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == VERIFIER
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    keys = set(load_file(str(folder / "model.safetensors")))
    assert "layers.0.self_attn.q_proj.weight" in keys and not any(k.startswith("midlayer.") for k in keys)
    aux, ids = _inputs(3)
    back = load_speculators(folder, embed_tokens=draft.embed_tokens.weight)
    assert back.config == draft.config
    with torch.no_grad():
        for a, b in zip(draft(aux, ids, steps=3), back(aux, ids, steps=3)):
            assert torch.equal(a, b)
    assert load_draft(folder).config == draft.config


@pytest.mark.parametrize("edit, match", [
    (lambda c: c.pop("norm_before_residual"), "norm_before_residual"),
    (lambda c: c.pop("eagle_aux_hidden_state_layer_ids"), "top-level eagle_aux_hidden_state_layer_ids is missing"),
    (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 14, 26]), r"capture\(s\) layers \[0, 13, 25\]"),
    (lambda c: c["speculators_config"].pop("verifier"), "verifier.name_or_path"),
])
def test_speculators_refusals(draft, tmp_path, edit, match):
    folder = _edit(export_speculators(draft, tmp_path / "spec", VERIFIER), config=edit)
    _refused(folder, match, loader=load_speculators)


def test_speculators_refuses_bad_weights(draft, tmp_path):
    folder = _edit(export_speculators(draft, tmp_path / "spec", VERIFIER),
                   tensors=lambda t: (t.pop("lm_head.weight"), t.__setitem__("d2t", t["d2t"] + torch.arange(N_DRAFT))))
    err = _refused(folder, "lm_head.weight is missing", loader=load_speculators)
    assert any("absolute" in p for p in err.problems)


def test_export_refuses_a_draft_without_vocab(tmp_path):
    with pytest.raises(ValueError, match="valid vocab"):
        export_sglang(Eagle3Draft(_config()), tmp_path / "novocab")
    assert not (tmp_path / "novocab").exists()
    shutil.rmtree(tmp_path, ignore_errors=True)


# ---- Eagle 3.1 norms (norm_before_fc, norm_output): vLLM serves them, SGLang and llama.cpp do not -------------

@pytest.fixture(scope="module")
def norms_draft() -> Eagle3Draft:
    return _draft(_config(norm_before_fc=True, norm_output=True), seed=4)


def test_eagle31_norms_change_the_draft_and_round_trip_through_vllms_format(draft, norms_draft, tmp_path):
    assert norms_draft.input_norm.weight.shape == (3 * H,) and not hasattr(draft, "input_norm")
    assert "norm_before_fc" not in draft.config.to_dict()  # identities recorded before the options still match
    assert norms_draft.config.to_dict()["norm_output"] is True
    folder = export_speculators(norms_draft, tmp_path / "spec", VERIFIER, dtype=torch.float32)
    cfg = json.loads((folder / "config.json").read_text())
    assert (cfg["norm_before_fc"], cfg["norm_output"], "fc_norm" in cfg) == (True, True, False)  # top level
    assert "input_norm.weight" in load_file(str(folder / "model.safetensors"))
    back = load_draft(folder, embed_tokens=norms_draft.embed_tokens.weight)
    assert back.config == norms_draft.config
    aux, ids = _inputs(5)
    with torch.no_grad():
        for a, b in zip(norms_draft(aux, ids, steps=3), back(aux, ids, steps=3)):
            assert torch.equal(a, b)
        # each option changes what the draft computes (a norm dropped on load would show)
        plain = Eagle3Draft(_config())
        plain.load_state_dict({k: v for k, v in norms_draft.state_dict().items() if k != "input_norm.weight"})
        assert not torch.allclose(plain(aux, ids, steps=1)[0], norms_draft(aux, ids, steps=1)[0])
        only_fc = Eagle3Draft(_config(norm_before_fc=True))
        only_fc.load_state_dict(norms_draft.state_dict())
        assert torch.equal(only_fc(aux, ids, steps=1)[0], norms_draft(aux, ids, steps=1)[0])  # step 0 is the same
        assert not torch.allclose(only_fc(aux, ids, steps=2)[1], norms_draft(aux, ids, steps=2)[1])  # norm_output


def test_eagle31_norms_are_refused_for_sglang_at_export_and_by_its_contract(draft, norms_draft, tmp_path):
    with pytest.raises(ValueError, match="SGLang has no Eagle 3.1 norms .*norm_before_fc, norm_output"):
        export_sglang(norms_draft, tmp_path / "sg")
    assert not (tmp_path / "sg").exists()
    # an SGLang folder someone gave the flags and the weight: the contract (export's read-back, the doctor) refuses
    folder = _edit(export_sglang(draft, tmp_path / "sg2"), config=lambda c: c.update(norm_before_fc=True),
                   tensors=lambda t: t.__setitem__("input_norm.weight", torch.ones(3 * H)))
    assert any(p.startswith("eagle31_norms: ") and "sglang has no such option" in p for p in check_sglang(folder))


@pytest.mark.parametrize("edit, match", [
    (dict(tensors=lambda t: t.pop("input_norm.weight")), "norm_before_fc is set but input_norm.weight is missing"),
    (dict(config=lambda c: c.pop("norm_before_fc")), "input_norm.weight is present but norm_before_fc is not true"),
    (dict(config=lambda c: c.update(fc_norm=True)), "fc_norm is True but 0 of its 3 weights"),
    (dict(tensors=lambda t: t.__setitem__("input_norm.weight", torch.ones(H))), r"input_norm.weight has shape \[64\]"),
])
def test_vllm_contract_matches_each_norm_flag_with_its_weights(norms_draft, tmp_path, edit, match):
    folder = _edit(export_speculators(norms_draft, tmp_path / "spec", VERIFIER), **edit)
    _refused(folder, match, loader=load_speculators)
