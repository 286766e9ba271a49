"""The serving-contract doctor: a real small draft exported for SGLang and vLLM, broken one way at a time
(docs/contracts.md silent failures 1-6, a draft for another target), must fail exactly the expected checks;
`fix=True` repairs the mechanical breakages into a copy that loads with identical logits and refuses the
others; every command the speculative sweep generates passes the launch check."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig

from serving.doctor import expected_aux_layer_ids_from_lineage, run_doctor
from serving.sglang.server import sglang_speculative_command, speculative_sweep
from tasks.model.draft import DraftConfig, Eagle3Draft
from serving.draft_folder import PROJECT_KEY
from serving.sglang.export import export_sglang, load_sglang
from serving.vllm.export import export_speculators, load_speculators
from tasks.extract.vocab import build_draft_vocab

from helpers import edit_export

H, LAYERS, V, N_DRAFT, AUX = 64, 8, 512, 128, (1, 3, 5)  # AUX is not the engines' default [1, 3, 4]


def _target_config(**overrides) -> LlamaConfig:
    fields = {"hidden_size": H, "num_hidden_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 128, "vocab_size": V, "tie_word_embeddings": False}
    return LlamaConfig(**{**fields, **overrides})


def _target_folder(folder: Path, **overrides) -> Path:
    folder.mkdir(parents=True)
    _target_config(**overrides).to_json_file(folder / "config.json")
    return folder


def _draft(aux=AUX, seed: int = 0) -> Eagle3Draft:
    torch.manual_seed(seed)
    draft = Eagle3Draft(DraftConfig.from_target_config(_target_config(), draft_vocab_size=N_DRAFT, aux_layer_ids=aux))
    with torch.no_grad():  # norms away from 1 so a dropped or swapped norm shows in the logits
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    vocab = build_draft_vocab(np.random.default_rng(seed).integers(0, 50, V), N_DRAFT)
    draft.set_vocab(vocab.d2t, vocab.t2d)
    return draft


@pytest.fixture(scope="module")
def draft() -> Eagle3Draft:
    return _draft()


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return _target_folder(tmp_path_factory.mktemp("t") / "target")


@pytest.fixture
def sglang_folder(draft, tmp_path) -> Path:
    return export_sglang(draft, tmp_path / "draft", dtype=torch.float32)


@pytest.fixture
def vllm_folder(draft, tmp_path) -> Path:
    return export_speculators(draft, tmp_path / "spec", "tiny-target", dtype=torch.float32)


_edit = edit_export  # one helper for every test that breaks an export


def _failed(report) -> set[str]:
    return {c.name for c in report.failed}


def _logits(draft: Eagle3Draft) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    aux, ids = torch.randn(2, 9, 3 * H, generator=g), torch.randint(0, V, (2, 9), generator=g)
    with torch.no_grad():
        return torch.stack(draft(aux, ids, steps=2))


def _rename(prefix_from: str, prefix_to: str):
    def edit(t: dict) -> None:
        for k in [k for k in t if k.startswith(prefix_from)]:
            t[prefix_to + k.removeprefix(prefix_from)] = t.pop(k)
    return edit


def _prefix_all(t: dict) -> None:
    for k in list(t):
        t["draft_model." + k] = t.pop(k)


def _ids_to_top_level(c: dict) -> None:
    c["eagle_aux_hidden_state_layer_ids"] = c.pop("eagle_config")["eagle_aux_hidden_state_layer_ids"]


def _absolute_d2t(t: dict) -> None:
    t["d2t"] = t["d2t"] + torch.arange(N_DRAFT)


# (id, config edit, tensor edit, the checks that must fail, message fragment)
MECHANICAL = [
    ("layers0-keys", None, _rename("midlayer.", "layers.0."), {"weight_keys"}, "layers.0"),          # failure 2
    ("draft_model-prefix", None, _prefix_all, {"weight_keys"}, "draft_model. prefix"),
    ("eagle_config-missing", lambda c: c.pop("eagle_config"), None, {"eagle_config", "aux_layers"},  # failure 3
     "falls back to its default layers"),
    ("ids-top-level", _ids_to_top_level, None, {"eagle_config", "aux_layers"}, "only at the top level"),
    ("ids-off-by-one", lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[2, 4, 6]), None,  # 4
     {"aux_layers"}, "before-pr25454 capture(s) layers [2, 4, 6] but the draft was trained on [1, 3, 5]"),
    ("use-aux-false", lambda c: c["eagle_config"].update(use_aux_hidden_state=False), None,
     {"use_aux_hidden_state"}, "no aux states"),
    ("tied-head", lambda c: c.update(tie_word_embeddings=True), None, {"tie_word_embeddings"},
     "drops this draft's lm_head"),
    ("d2t-absolute", None, _absolute_d2t, {"vocab_mapping"}, "absolute target ids"),                  # failure 5
]

NOT_MECHANICAL = [
    ("d2t-missing", None, lambda t: t.pop("d2t"), {"required_tensors"}, "d2t is missing"),            # failure 5
    ("lm_head-missing", None, lambda t: t.pop("lm_head.weight"), {"required_tensors"},              # failure 6
     "lm_head.weight is missing"),
    ("fc-2H", None, lambda t: t.update({"fc.weight": torch.randn(H, 2 * H)}), {"fc_shape"},          # failure 6
     f"3 x target hidden = {3 * H}"),
    ("q_proj-H", None, lambda t: t.update({"midlayer.self_attn.q_proj.weight": torch.randn(H, H)}), {"q_proj_input"},
     "2 x hidden"),
    ("eagle1-architecture", lambda c: c.update(architectures=["LlamaForCausalLMEagle"]), None, {"architecture"},
     "LlamaForCausalLMEagle3"),
    ("unknown-key", None, lambda t: t.update({"extra.weight": torch.zeros(3)}), {"weight_keys"}, "extra.weight"),
    ("draft-vocab-size", lambda c: c.update(draft_vocab_size=100), None, {"lm_head_rows", "vocab_mapping"},
     "draft_vocab_size is 100"),
]


def test_clean_export_passes_with_a_one_line_summary(sglang_folder, target):
    report = run_doctor(sglang_folder, target)
    assert report.passed, report.failure_lines()
    assert not report.warnings
    line = report.summary_line()
    assert "\n" not in line and line.startswith("PASS sglang")
    for fragment in ("LlamaForCausalLMEagle3", "[1, 3, 5]", f"draft vocab {N_DRAFT} of {V}", f"hidden {H}"):
        assert fragment in line


@pytest.mark.parametrize("name,config,tensors,expected,fragment", MECHANICAL + NOT_MECHANICAL,
                         ids=[c[0] for c in MECHANICAL + NOT_MECHANICAL])
def test_each_breakage_fails_exactly_its_checks(sglang_folder, target, name, config, tensors, expected, fragment):
    report = run_doctor(_edit(sglang_folder, config, tensors), target)
    assert _failed(report) == expected, report.failure_lines()
    assert fragment in " ".join(report.failure_lines())
    assert len(report.failure_lines()) == len(expected) and report.summary_line().startswith("FAIL")


@pytest.mark.parametrize("name,config,tensors,expected,fragment", MECHANICAL, ids=[c[0] for c in MECHANICAL])
def test_fix_repairs_mechanical_breakages_into_an_identical_draft(draft, sglang_folder, target, name, config, tensors,
                                                                 expected, fragment):
    _edit(sglang_folder, config, tensors)
    before = (sglang_folder / "config.json").read_bytes(), (sglang_folder / "model.safetensors").read_bytes()
    report = run_doctor(sglang_folder, target, fix=True)
    assert not report.passed and report.fixed_dir == sglang_folder.with_name(sglang_folder.name + "-fixed")
    assert report.fixed.passed, report.fixed.failure_lines()
    assert report.fixes
    # The original is never touched; the copy serves the very draft that was trained.
    assert before == ((sglang_folder / "config.json").read_bytes(), (sglang_folder / "model.safetensors").read_bytes())
    fixed = load_sglang(report.fixed_dir, embed_tokens=draft.embed_tokens.weight)
    assert torch.equal(_logits(fixed), _logits(draft))
    assert torch.equal(fixed.d2t, draft.d2t)


def test_fix_repairs_several_mechanical_breakages_at_once(draft, sglang_folder, target):
    def tensors(t):
        _rename("midlayer.", "layers.0.")(t)
        _absolute_d2t(t)

    _edit(sglang_folder, lambda c: (_ids_to_top_level(c), c.update(tie_word_embeddings=True)), tensors)
    report = run_doctor(sglang_folder, target, fix=True, fix_dir=sglang_folder.parent / "repaired")
    assert _failed(report) == {"weight_keys", "vocab_mapping", "eagle_config", "aux_layers", "tie_word_embeddings"}
    assert report.fixed_dir == sglang_folder.parent / "repaired" and report.fixed.passed
    fixed = load_sglang(report.fixed_dir, embed_tokens=draft.embed_tokens.weight)
    assert torch.equal(_logits(fixed), _logits(draft))


@pytest.mark.parametrize("name,config,tensors,expected,fragment", NOT_MECHANICAL, ids=[c[0] for c in NOT_MECHANICAL])
def test_fix_refuses_what_is_not_mechanical(sglang_folder, target, name, config, tensors, expected, fragment):
    _edit(sglang_folder, config, tensors)
    report = run_doctor(sglang_folder, target, fix=True)
    assert report.fixed_dir is None and report.fixed is None
    assert not sglang_folder.with_name(sglang_folder.name + "-fixed").exists()
    assert all(any(line.startswith(check) for line in report.not_fixed) for check in expected)


def test_a_mechanical_breakage_next_to_a_real_one_is_not_half_fixed(sglang_folder, target):
    _edit(sglang_folder, None, lambda t: (_rename("midlayer.", "layers.0.")(t), t.pop("lm_head.weight")))
    report = run_doctor(sglang_folder, target, fix=True)
    assert _failed(report) == {"weight_keys", "required_tensors"} and report.fixed_dir is None


def test_draft_for_another_target_fails_on_hidden_size_and_vocab(sglang_folder, tmp_path):
    wider = run_doctor(sglang_folder, _target_folder(tmp_path / "wide", hidden_size=2 * H))
    assert _failed(wider) == {"hidden_size", "fc_shape"}, wider.failure_lines()
    bigger_vocab = run_doctor(sglang_folder, _target_config(vocab_size=2 * V).to_dict())
    assert _failed(bigger_vocab) == {"target_vocab"}, bigger_vocab.failure_lines()
    assert f"the target's is {2 * V}" in bigger_vocab.failure_lines()[0]
    deeper = run_doctor(sglang_folder, _target_config(num_hidden_layers=12).to_dict())
    assert _failed(deeper) == {"aux_layers"} and "8-layer target" in deeper.failure_lines()[0]


def test_missing_eagle_config_with_default_layers_fails_only_the_config(target, tmp_path):
    folder = export_sglang(_draft(aux=(1, LAYERS // 2 - 1, LAYERS - 4)), tmp_path / "d", dtype=torch.float32)
    report = run_doctor(_edit(folder, lambda c: c.pop("eagle_config")), target)
    assert _failed(report) == {"eagle_config"}  # SGLang's default capture happens to be the trained layers


def test_unverifiable_layers_warn_and_version_dependent_ids_fail(sglang_folder, target):
    _edit(sglang_folder, lambda c: c.pop(PROJECT_KEY))
    report = run_doctor(sglang_folder, target)
    assert report.passed and [c.name for c in report.warnings] == ["aux_layers"]
    assert "cannot verify" in report.warning_lines()[0] and "1 warning(s)" in report.summary_line()
    # With a caller's expectation the same folder is verified.
    assert not run_doctor(sglang_folder, target, expected_aux_layer_ids=[1, 3, 5]).warnings
    # [2, 4, 6] means [2, 4, 6] before SGLang PR #25454 and [1, 3, 5] since: one of them is wrong.
    _edit(sglang_folder, lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[2, 4, 6]))
    assert _failed(run_doctor(sglang_folder, target)) == {"aux_layers"}
    assert run_doctor(sglang_folder, target, sglang_version="since-pr25454").passed


def test_pickle_only_folder_is_refused_without_reading_it(tmp_path, target):
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "pytorch_model.bin").write_bytes(b"not read")
    report = run_doctor(folder, target)
    assert _failed(report) == {"files"} and "pickle" in report.failure_lines()[0]


# ---- launch commands ----------------------------------------------------------------------------------

def _launch(folder: Path, target: Path, **kw) -> list[str]:
    return sglang_speculative_command(target, folder, kw.pop("steps", 3), kw.pop("topk", 1), kw.pop("ndt", 4), **kw)


def _swap(cmd: list[str] | str, flag: str, value: str | None) -> str:
    """The command with `flag`'s value replaced (None: the flag removed)."""
    cmd = shlex.split(cmd) if isinstance(cmd, str) else cmd
    i = cmd.index(flag)
    return shlex.join(cmd[:i] + ([flag, value] if value is not None else []) + cmd[i + 2:])


def test_generated_command_passes_and_reads_the_checkpoint(sglang_folder, target):
    cmd = _launch(sglang_folder, target, cuda_graphs=False, tp=8, port=31000)
    assert cmd[cmd.index("--speculative-algorithm") + 1] == "EAGLE3" and "--disable-cuda-graph" in cmd
    report = run_doctor(sglang_folder, target, launch=shlex.join(cmd))
    assert report.passed, report.failure_lines()
    with pytest.raises(ValueError, match="speculators"):
        _launch(export_speculators(_draft(), sglang_folder.parent / "s", "t"), target)
    with pytest.raises(ValueError, match="rewrites"):
        _launch(sglang_folder, target, steps=3, topk=1, ndt=8)


@pytest.mark.parametrize("flag,value,expected,fragment", [
    ("--speculative-algorithm", "EAGLE", "launch_algorithm", "acceptance is ~1.0"),        # failure 1
    ("--speculative-algorithm", "NEXTN", "launch_algorithm", "needs EAGLE3"),
    ("--speculative-algorithm", None, "launch_algorithm", "would not speculate"),
    ("--speculative-num-steps", None, "launch_speculative_params", "--speculative-num-steps not given"),
    ("--speculative-num-draft-tokens", "6", "launch_speculative_params", "silently rewrites"),
    ("--speculative-eagle-topk", "x", "launch_speculative_params", "not a whole number"),
])
def test_launch_flag_breakages(sglang_folder, target, flag, value, expected, fragment):
    report = run_doctor(sglang_folder, target, launch=_swap(_launch(sglang_folder, target), flag, value))
    assert _failed(report) == {expected}, report.failure_lines()
    assert fragment in report.failure_lines()[0]


def test_launch_with_another_draft_tree_or_target_fails(sglang_folder, target, tmp_path, monkeypatch):
    other = export_sglang(_draft(seed=1), tmp_path / "other-draft", dtype=torch.float32)
    cmd = _launch(sglang_folder, target)
    report = run_doctor(sglang_folder, target, launch=_swap(cmd, "--speculative-draft-model-path", str(other)))
    assert _failed(report) == {"launch_draft_path"} and "is not this draft" in report.failure_lines()[0]
    # Another spelling of the same folder (relative, abbreviated flag) is the same draft.
    monkeypatch.chdir(other)
    relative = _swap(cmd, "--speculative-draft-model-path", str(Path("..") / sglang_folder.name))
    assert run_doctor(sglang_folder, target, launch=relative.replace("--speculative-algorithm", "--speculative-algo")).passed
    # One top-2 step offers 2 draft tokens: 8 cannot be built.
    tree = _swap(_swap(_swap(cmd, "--speculative-eagle-topk", "2"), "--speculative-num-steps", "1"),
                 "--speculative-num-draft-tokens", "8")
    report = run_doctor(sglang_folder, target, launch=tree)
    assert _failed(report) == {"launch_speculative_params"} and "at most 3" in report.failure_lines()[0]
    wide = _target_folder(tmp_path / "wide", hidden_size=2 * H)
    report = run_doctor(sglang_folder, target, launch=_swap(cmd, "--model-path", str(wide)))
    assert _failed(report) == {"launch_target"} and "hidden_size 128 vs 64" in report.failure_lines()[0]
    vllm = f"vllm serve {target} --speculative-config '{{\"method\": \"eagle3\"}}'"
    assert _failed(run_doctor(sglang_folder, target, launch=vllm)) == {"launch_command"}


def test_every_sweep_command_passes_the_launch_check(sglang_folder, target):
    points = list(speculative_sweep(target, sglang_folder, num_steps=(1, 2, 3, 5), eagle_topk=(1, 2, 4),
                                    num_draft_tokens=(2, 4, 8, 16), cuda_graphs=(True, False), tp=8))
    settings = {(p.num_steps, p.eagle_topk, p.num_draft_tokens, p.cuda_graphs) for p in points}
    assert len(settings) == len(points)
    assert (3, 1, 4, True) in settings and (3, 1, 4, False) in settings  # topk 1 gets steps + 1 draft tokens
    assert all(n == s + 1 for s, k, n, _ in settings if k == 1)
    assert (1, 2, 4, True) not in settings and (1, 2, 3, True) not in settings  # one top-2 step holds 2 drafts
    assert (1, 2, 2, True) in settings and (2, 4, 16, True) in settings
    for p in points:
        assert ("--disable-cuda-graph" in p.command) is not p.cuda_graphs
        report = run_doctor(sglang_folder, target, launch=shlex.join(p.command))
        assert report.passed, (p, report.failure_lines())


# ---- vLLM / speculators ------------------------------------------------------------------------------

def _vllm_launch(target: Path, folder: Path, **spec) -> str:
    config = {"method": "eagle3", "model": str(folder), "num_speculative_tokens": 3, **spec}
    return shlex.join(["vllm", "serve", str(target), "--tensor-parallel-size", "8", "--speculative-config",
                       json.dumps({k: v for k, v in config.items() if v is not None})])


def test_vllm_export_passes_and_its_breakages_fail(draft, vllm_folder, target, sglang_folder):
    report = run_doctor(vllm_folder, target, engine="vllm", launch=_vllm_launch(target, vllm_folder))
    assert report.passed, report.failure_lines()
    assert report.summary_line().startswith("PASS vllm: Eagle3Speculator")
    wrong = run_doctor(vllm_folder, target, engine="vllm", launch=_vllm_launch(target, vllm_folder, method="eagle"))
    assert _failed(wrong) == {"launch_algorithm"} and "needs \"eagle3\"" in wrong.failure_lines()[0]
    guessed = run_doctor(vllm_folder, target, engine="vllm", launch=_vllm_launch(target, vllm_folder, method=None))
    assert _failed(guessed) == {"launch_algorithm"}
    assert "architecture" in _failed(run_doctor(sglang_folder, target, engine="vllm"))
    assert "architecture" in _failed(run_doctor(vllm_folder, target, engine="sglang"))
    _edit(vllm_folder, lambda c: c.pop("eagle_aux_hidden_state_layer_ids"))
    assert _failed(run_doctor(vllm_folder, target, engine="vllm")) == {"eagle_config", "aux_layers"}


def test_vllm_fix_restores_norm_before_residual(draft, vllm_folder, target):
    _edit(vllm_folder, lambda c: c.pop("norm_before_residual"), _prefix_all)
    report = run_doctor(vllm_folder, target, engine="vllm", fix=True)
    assert _failed(report) == {"norm_before_residual", "weight_keys"}
    assert report.fixed.passed, report.fixed.failure_lines()
    fixed = load_speculators(report.fixed_dir, embed_tokens=draft.embed_tokens.weight)
    assert torch.equal(_logits(fixed), _logits(draft))


# ---- lineage -----------------------------------------------------------------------------------------

def test_expected_layers_come_from_lineage(sglang_folder, target, tmp_path):
    from storage.lineage import LineageStore

    db = tmp_path / "ws" / "lineage.duckdb"
    assert expected_aux_layer_ids_from_lineage(db, sglang_folder) is None  # no store yet
    store = LineageStore(db)
    row = {"checkpoint": "run/sglang-step-1", "run_name": "run", "step": 1, "format": "sglang",
           "path": str(sglang_folder), "sha256": "x", "rounds": 1, "target": "tiny", "target_revision": "r",
           "aux_layer_ids": [1, 3, 4], "vocab_id": "v", "extract_key": "ek"}
    store.checkpoints.register("run-id", row)
    assert expected_aux_layer_ids_from_lineage(db, sglang_folder) == [1, 3, 4]
    assert expected_aux_layer_ids_from_lineage(db, tmp_path / "elsewhere") is None
    # Lineage says [1, 3, 4], the folder says it was trained on [1, 3, 5]: refused, and not "fixed".
    report = run_doctor(sglang_folder, target, expected_aux_layer_ids=[1, 3, 4], fix=True)
    assert _failed(report) == {"aux_layers"} and "lineage" in report.failure_lines()[0]
    assert report.fixed_dir is None
    store.extraction.register_settings("run-id", "ek", "v", {"aux_layer_ids": [1, 3, 6]})
    with pytest.raises(ValueError, match="extraction used"):
        expected_aux_layer_ids_from_lineage(db, sglang_folder)
