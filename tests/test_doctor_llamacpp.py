"""The doctor for llama.cpp: a real SGLang export for SmolLM2, converted once by llama.cpp's own converter,
then broken one way at a time (the folder the converter reads, the GGUF llama-server loads, the
`llama-server` command) must fail exactly the named check; `fix=True` repairs a folder into a copy
that passes and re-converts a GGUF from its SGLang export; the CLI exits 1 with the named line."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from serving.doctor import run_doctor
from serving.launch import engine_arguments
from serving.llamacpp.export import export_gguf, gguf_reader, read_gguf_draft, target_folder_for
from tasks.model.target import smollm2_gguf_path

from helpers import TARGET_CACHE, random_smollm2_export, edit_export

pytestmark = pytest.mark.slow  # starts servers, vLLM or `eagle3` processes: not in `make test-fast`

N_DRAFT, LAYERS, HIDDEN, VOCAB = 256, 30, 576, 49152  # SmolLM2-135M
AUX = (3, 10, 20)  # trained layers (output of layer i); not the converter's default [1, 14, 26]
IDS = [4, 11, 21]  # what llama.cpp must read: inputs of layers i+1
STEP = "step-00000001"


@pytest.fixture(scope="module")
def target() -> Path:
    return target_folder_for(cache_dir=TARGET_CACHE)


def _export(target: Path, folder: Path, aux=AUX, seed: int = 0) -> Path:
    return random_smollm2_export(target, folder, aux, seed, N_DRAFT, sglang_version="before-pr25454")  # ids [3, 10, 20]


@pytest.fixture(scope="module")
def built(target, tmp_path_factory) -> Path:
    """export/sglang-step-N and export/gguf-step-N/draft.gguf, laid out as the training flow writes them."""
    root = tmp_path_factory.mktemp("llamacpp") / "export"
    sglang = _export(target, root / f"sglang-{STEP}")
    export_gguf(sglang, target, root / f"gguf-{STEP}" / "draft.gguf")
    return root


_edit = edit_export  # one helper for every test that breaks an export


@pytest.fixture
def folder(built, tmp_path) -> Path:
    """What the converter should read: the SGLang export plus the top-level ids llama.cpp needs."""
    copy = Path(shutil.copytree(built / f"sglang-{STEP}", tmp_path / "draft"))
    return _edit(copy, lambda c: c.update(eagle_aux_hidden_state_layer_ids=IDS))


@pytest.fixture
def gguf(built, tmp_path) -> Path:
    """A copy of the converted GGUF with no SGLang export beside it."""
    (tmp_path / "alone").mkdir()
    return Path(shutil.copy(built / f"gguf-{STEP}" / "draft.gguf", tmp_path / "alone" / "draft.gguf"))


def _open_rw(path: Path):
    """The GGUF reader serving.llamacpp.export uses, on a writable memory map."""
    return gguf_reader(path, "r+")


def _patch(path: Path, key: str, values) -> Path:
    """Overwrite a GGUF's metadata value (scalar or array, same length) in place."""
    reader = _open_rw(path)
    field = reader.fields[key]
    for i, v in zip(field.data, values if isinstance(values, (list, tuple)) else [values], strict=True):
        field.parts[i][0] = v
    reader.memmap.flush()
    return path


def _patch_d2t(path: Path, edit) -> Path:
    reader = _open_rw(path)
    edit(next(t for t in reader.tensors if t.name == "d2t").data)
    reader.memmap.flush()
    return path


def _failed(report) -> set[str]:
    return {c.name for c in report.failed}


def _launch(draft: Path, model: Path | None = None, *extra: str, drop: str | None = None) -> str:
    cmd = ["/opt/llama/bin/llama-server", "-m", str(model or smollm2_gguf_path()), "-md", str(draft),
           "--spec-type", "draft-eagle3", "--spec-draft-n-max", "3", "--spec-draft-p-min", "0.0", "-np", "1",
           "--port", "8080", *extra]
    if drop is not None:
        i = cmd.index(drop)
        cmd = cmd[:i] + cmd[i + 2:]
    return shlex.join(cmd)


# ---- the folder the converter reads -------------------------------------------------------------------

def test_intact_folder_passes(folder, target):
    report = run_doctor(folder, target, engine="llamacpp")
    assert report.passed and not report.warnings, report.failure_lines() + report.warning_lines()
    assert report.summary_line().startswith("PASS llamacpp") and str(list(AUX)) in report.summary_line()
    names = [c.name for c in report.checks]
    for name in ("architecture", "aux_ids_missing", "aux_ids_off_by_one", "aux_layers", "norms", "vocab_mapping"):
        assert name in names
    assert "use_aux_hidden_state" not in names and "tie_word_embeddings" not in names  # the converter reads neither


def _two_ids(c):
    c["eagle_aux_hidden_state_layer_ids"] = IDS[:2]


FOLDER_BREAKAGES = [
    ("ids-missing", lambda c: c.pop("eagle_aux_hidden_state_layer_ids"), None, "aux_ids_missing",
     "falls back to its default target_layers [2, 15, 27]"),
    ("ids-unshifted", lambda c: c.update(eagle_aux_hidden_state_layer_ids=list(AUX)), None, "aux_ids_off_by_one",
     "INPUT of layer k"),
    ("two-ids", _two_ids, None, "aux_layers", "exactly 3"),
    ("d2t-absolute", None, lambda t: t.update(d2t=t["d2t"] + torch.arange(N_DRAFT)), "vocab_mapping",
     "shifted again"),
    ("norm-before-residual", lambda c: c.update(norm_before_residual=True), None, "norms", "both false"),
]


@pytest.mark.parametrize("name,config,tensors,expected,fragment", FOLDER_BREAKAGES,
                         ids=[b[0] for b in FOLDER_BREAKAGES])
def test_folder_breakage_fails_its_check_and_fix_repairs_it(folder, target, name, config, tensors, expected, fragment):
    _edit(folder, config, tensors)
    before = (folder / "config.json").read_bytes(), (folder / "model.safetensors").read_bytes()
    report = run_doctor(folder, target, engine="llamacpp", fix=True)
    assert _failed(report) == {expected}, report.failure_lines()
    assert fragment in report.failure_lines()[0]
    assert report.fixed is not None and report.fixed.passed, (report.not_fixed, report.fixed)
    assert before == ((folder / "config.json").read_bytes(), (folder / "model.safetensors").read_bytes())
    fixed = json.loads((report.fixed_dir / "config.json").read_text())
    assert fixed["eagle_aux_hidden_state_layer_ids"] == IDS
    assert fixed["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(AUX)  # SGLang's, left alone


def test_plain_sglang_export_reads_default_layers_and_converts_right_after_fix(built, target, tmp_path):
    export = built / f"sglang-{STEP}"
    report = run_doctor(export, target, engine="llamacpp", fix=True, fix_dir=tmp_path / "fixed")
    assert _failed(report) == {"aux_ids_missing"}
    assert "the eagle_config ids [3, 10, 20] are SGLang's" in report.failure_lines()[0]
    assert report.fixed.passed and report.fixed_dir == tmp_path / "fixed"


def test_missing_ids_that_match_the_default_by_luck_warn(target, tmp_path):
    lucky = _export(target, tmp_path / "lucky", aux=(1, LAYERS // 2 - 1, LAYERS - 4))  # the converter's default
    report = run_doctor(lucky, target, engine="llamacpp")
    assert report.passed and [c.name for c in report.warnings] == ["aux_ids_missing"]
    assert "by luck" in report.warning_lines()[0]


# ---- the GGUF llama-server loads ----------------------------------------------------------------------

def test_converted_gguf_passes(built, gguf, target):
    beside = run_doctor(built / f"gguf-{STEP}", target, engine="llamacpp")  # the layers come from its SGLang export
    assert beside.passed and not beside.warnings, beside.failure_lines() + beside.warning_lines()
    assert f"converted from {built / f'sglang-{STEP}'}" in beside.check("files").message
    assert beside.summary_line().startswith("PASS llamacpp: eagle3") and str(list(AUX)) in beside.summary_line()
    alone = run_doctor(gguf, target, engine="llamacpp")
    assert alone.passed and [c.name for c in alone.warnings] == ["aux_layers"]  # nothing says what was trained
    assert not run_doctor(gguf, target, engine="llamacpp", expected_aux_layer_ids=AUX).warnings


@pytest.mark.parametrize("name,patch,expected,fragment", [
    ("target-layers-unshifted", lambda p: _patch(p, "eagle3.target_layers", list(AUX)), "aux_ids_off_by_one",
     "one layer too early"),
    ("target-layers-last", lambda p: _patch(p, "eagle3.target_layers", [4, 11, LAYERS]), "aux_layers", "nextn"),
    ("target-hidden-size", lambda p: _patch(p, "eagle3.target_hidden_size", 512), "target_hidden_size",
     "eagle3.target_hidden_size is 512"),
    ("d2t-duplicate", lambda p: _patch_d2t(p, lambda d: d.__setitem__(1, d[0])), "d2t", "duplicate"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_gguf_breakage_fails_exactly_its_check(gguf, target, name, patch, expected, fragment):
    report = run_doctor(patch(gguf), target, engine="llamacpp", expected_aux_layer_ids=AUX, fix=True)
    assert _failed(report) == {expected}, report.failure_lines()
    assert fragment in report.failure_lines()[0]
    # No SGLang export beside it: a GGUF is not edited, so there is nothing mechanical to do.
    assert report.fixed_dir is None and "no SGLang export of it is known" in report.failure_lines()[0]


def test_draft_for_another_target_is_named(gguf, tmp_path):
    other = json.loads((target_folder_for(cache_dir=TARGET_CACHE) / "config.json").read_text())
    report = run_doctor(gguf, {**other, "hidden_size": 64, "vocab_size": 32000}, engine="llamacpp",
                        expected_aux_layer_ids=AUX)
    assert _failed(report) == {"hidden_size", "target_hidden_size", "fc_shape", "target_vocab", "d2t"}
    assert "built for another target" in report.check("hidden_size").message


def test_fix_reconverts_a_gguf_from_its_sglang_export(built, target, tmp_path):
    root = Path(shutil.copytree(built, tmp_path / "export"))
    folder = root / f"gguf-{STEP}"
    _patch(folder / "draft.gguf", "eagle3.target_layers", list(AUX))
    before = (folder / "draft.gguf").read_bytes()
    report = run_doctor(folder, target, engine="llamacpp", fix=True)
    assert _failed(report) == {"aux_ids_off_by_one"} and "re-converts it" in report.failure_lines()[0]
    assert report.fixed_dir == folder.with_name(folder.name + "-fixed") and report.fixed.passed, report.not_fixed
    assert read_gguf_draft(report.fixed_dir / "draft.gguf").target_layers == IDS
    assert (folder / "draft.gguf").read_bytes() == before


# ---- the llama-server command -------------------------------------------------------------------------

def test_engine_arguments_recognise_llama_server():
    assert engine_arguments(["./build/bin/llama-server", "-m", "t.gguf"], "llamacpp") == ["-m", "t.gguf"]
    assert engine_arguments(["vllm", "serve", "x"], "llamacpp") is None
    assert engine_arguments(["llama-server", "-m", "t.gguf"], "sglang") is None


def test_a_right_command_passes(gguf, target):
    report = run_doctor(gguf, target, engine="llamacpp", launch=_launch(gguf), expected_aux_layer_ids=AUX)
    assert report.passed and not report.warnings, report.failure_lines() + report.warning_lines()
    assert report.check("launch_target").message.startswith("-m is the GGUF the target folder was converted from")


@pytest.mark.parametrize("name,command,expected,fragment", [
    ("no-spec-type", lambda g: _launch(g, drop="--spec-type"), "launch_spec_type", "does not recognise"),
    ("ngram-only", lambda g: _launch(g, None, "--spec-type", "ngram-mod").replace("draft-eagle3", "ngram-simple"),
     "launch_spec_type", "has no draft-eagle3"),
    ("draft-max", lambda g: _launch(g, None, "--draft-max", "8"), "launch_removed_flags", "--spec-draft-n-max"),
    ("draft-as-target", lambda g: _launch(g, g), "launch_target", "EAGLE-3 draft GGUF"),
    ("another-draft", lambda g: _launch(smollm2_gguf_path()), "launch_draft_path", "is not this draft"),
    ("no-target", lambda g: _launch(g, drop="-m"), "launch_target", "no -m"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_launch_breakage_fails_exactly_its_check(gguf, target, name, command, expected, fragment):
    report = run_doctor(gguf, target, engine="llamacpp", launch=command(gguf), expected_aux_layer_ids=AUX)
    assert _failed(report) == {expected}, report.failure_lines()
    assert fragment in report.failure_lines()[0]


def test_p_min_above_zero_warns_and_another_engine_is_named(gguf, target):
    report = run_doctor(gguf, target, engine="llamacpp", expected_aux_layer_ids=AUX,
                        launch=_launch(gguf).replace("--spec-draft-p-min 0.0", "--spec-draft-p-min 0.75"))
    assert report.passed and [c.name for c in report.warnings] == ["launch_p_min"]
    # A draft from a hub repo: llama.cpp infers draft-eagle3 only from an EAGLE-3 sidecar there; neither is verifiable.
    hub = run_doctor(gguf, target, engine="llamacpp", expected_aux_layer_ids=AUX,
                     launch=f"llama-server -m {smollm2_gguf_path()} -hfd org/eagle3-draft --spec-draft-n-max 3")
    assert hub.passed and {c.name for c in hub.warnings} == {"launch_spec_type", "launch_draft_path"}
    vllm = run_doctor(gguf, target, engine="llamacpp", launch="vllm serve m --speculative-config '{}'",
                      expected_aux_layer_ids=AUX)
    assert _failed(vllm) == {"launch_command"} and "engine='vllm'" in vllm.failure_lines()[0]


def test_folder_draft_with_its_conversion(built, folder, target, tmp_path):
    converted = built / f"gguf-{STEP}" / "draft.gguf"
    assert run_doctor(folder, target, engine="llamacpp", launch=_launch(converted)).passed
    report = run_doctor(folder, target, engine="llamacpp", launch=_launch(folder))
    assert _failed(report) == {"launch_draft_path"} and "llama-server loads a GGUF" in report.failure_lines()[0]
    other = export_gguf(_export(target, tmp_path / "other", seed=1), target, tmp_path / "other.gguf")
    report = run_doctor(folder, target, engine="llamacpp", launch=_launch(other))
    assert _failed(report) == {"launch_draft_path"} and "final norm" in report.failure_lines()[0]


# ---- the CLI ------------------------------------------------------------------------------------------

def test_cli_names_the_failed_check_and_reads_lineage_for_a_gguf(gguf, target, tmp_path):
    from flows.cli import app
    from storage.lineage import LineageStore

    args = ["doctor", str(gguf), "--engine", "llamacpp", "--target", str(target), "-w", str(tmp_path / "ws")]
    bad = CliRunner().invoke(app, [*args, "--launch", _launch(gguf, drop="--spec-type")])
    assert bad.exit_code == 1, bad.output
    assert "launch_spec_type: no --spec-type" in bad.output
    ok = CliRunner().invoke(app, [*args, "--launch", _launch(gguf)])
    assert ok.exit_code == 0 and "PASS llamacpp: eagle3" in ok.output, ok.output
    assert "aux_layers (warning): cannot verify" in ok.output
    # Lineage registers the folder holding the GGUF: the file's trained layers are found through it.
    LineageStore(tmp_path / "ws" / "lineage.duckdb").checkpoints.register("run-id", {
        "checkpoint": "run/gguf-step-1", "run_name": "run", "step": 1, "format": "gguf", "path": str(gguf.parent),
        "sha256": "x", "rounds": 1, "target": "smollm2", "target_revision": "r", "aux_layer_ids": list(AUX),
        "vocab_id": "v", "extract_key": "ek"})
    verified = CliRunner().invoke(app, args)
    assert verified.exit_code == 0 and "warning" not in verified.output, verified.output
    assert f"captures target layers {list(AUX)}" in verified.output
    assert read_gguf_draft(gguf).target_layers == IDS
