"""GGUF export by llama.cpp's own converter: llama.cpp's layer ids (input of layer i+1), the top-level
key the converter reads (non-default ids prove it is honoured), d2t written as absolute ids, a
converter failure named with its folder and output, and llama-server drafting with the result."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from serving.llamacpp.export import (GGUF_ARCHITECTURE, REQUIRED_TENSORS, GGUFExportError, export_gguf, gguf_draft_problems,
                                     read_gguf_draft, target_folder_for)
from serving.llamacpp.layers import llamacpp_capture_layers, llamacpp_layer_ids

from helpers import TARGET_CACHE, random_smollm2_export

pytestmark = pytest.mark.slow  # starts servers, vLLM or `eagle3` processes: not in `make test-fast`

N_DRAFT, LAYERS, HIDDEN, VOCAB = 256, 30, 576, 49152  # SmolLM2-135M: 30 layers, hidden 576


@pytest.fixture(scope="module")
def target() -> Path:
    """The embedded SmolLM2 target as an HF folder (config.json + tokenizer), the converter's --target-model-dir."""
    folder = target_folder_for(cache_dir=TARGET_CACHE)
    config = json.loads((folder / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (LAYERS, HIDDEN, VOCAB)
    return folder


def _sglang_export(target: Path, folder: Path, aux: tuple[int, int, int], seed: int = 0, **kwargs) -> Path:
    return random_smollm2_export(target, folder, aux, seed, N_DRAFT, **kwargs)


@pytest.fixture(scope="module")
def default_ids(target, tmp_path_factory) -> tuple[Path, Path, float]:
    """(sglang folder, GGUF, seconds) for a draft on layers [1, 14, 26], SGLang's default for 30 layers."""
    root = tmp_path_factory.mktemp("gguf-default")
    sglang = _sglang_export(target, root / "sglang", (1, 14, 26))
    started = time.monotonic()
    gguf = export_gguf(sglang, target, root / "gguf" / "draft.gguf")
    return sglang, gguf, time.monotonic() - started


def test_llamacpp_ids_name_the_input_of_the_next_layer():
    assert llamacpp_layer_ids([1, 14, 26], LAYERS) == [2, 15, 27]
    assert llamacpp_layer_ids([0, 10, 28], LAYERS) == [1, 11, 29]
    assert llamacpp_capture_layers([2, 15, 27], LAYERS) == [1, 14, 26]
    assert llamacpp_capture_layers([0, 1, 30], LAYERS) == [None, 0, None]  # embeddings, nextn: no layer output
    with pytest.raises(ValueError, match=r"output of the target's last layer \(30 layers\).*nextn"):
        llamacpp_layer_ids([1, 14, 29], LAYERS)
    with pytest.raises(ValueError, match="exactly 3"):
        llamacpp_layer_ids([1, 14], LAYERS)
    with pytest.raises(ValueError, match="not a layer"):
        llamacpp_layer_ids([1, 14, 40], LAYERS)


def test_gguf_says_what_the_draft_was_trained_on(default_ids):
    sglang, gguf, seconds = default_ids
    info = read_gguf_draft(gguf)
    assert info.architecture == GGUF_ARCHITECTURE
    assert info.target_layers == [2, 15, 27]
    assert (info.target_hidden_size, info.hidden_size, info.vocab_size) == (HIDDEN, HIDDEN, VOCAB)
    assert info.norm_before_residual is False and info.norm_before_fc is False
    offsets = load_file(str(sglang / "model.safetensors"))["d2t"].numpy()
    assert info.draft_vocab_size == N_DRAFT and info.tensor_shapes["output.weight"] == (N_DRAFT, HIDDEN)
    assert info.d2t.dtype == np.int64 and np.array_equal(info.d2t, offsets + np.arange(N_DRAFT))
    assert np.unique(info.d2t).size == N_DRAFT and info.d2t.max() < VOCAB
    assert info.tensor_shapes["fc.weight"] == (HIDDEN, 3 * HIDDEN)
    assert set(REQUIRED_TENSORS) <= set(info.tensor_names) and "t2d" not in info.tensor_names
    assert (info.tokenizer_model, info.tokenizer_pre, info.tokenizer_tokens) == ("gpt2", "smollm", VOCAB)
    assert info.tensor_types["fc.weight"] == "F32" and info.tensor_types["d2t"] == "I64"
    assert gguf_draft_problems(info, target_layers=[2, 15, 27], target_hidden_size=HIDDEN, target_vocab_size=VOCAB,
                               d2t_offsets=offsets) == []
    # nothing but the GGUF is left beside it (no staging folder, no temporary file)
    assert [p.name for p in gguf.parent.iterdir()] == ["draft.gguf"]
    print(f"conversion took {seconds:.1f} s")


def test_problems_name_each_mismatch(default_ids):
    sglang, gguf, _ = default_ids
    info = read_gguf_draft(gguf)
    offsets = load_file(str(sglang / "model.safetensors"))["d2t"].numpy()
    found = gguf_draft_problems(info, target_layers=[1, 14, 26], target_hidden_size=64, d2t_offsets=offsets + 1,
                                norm_before_residual=True)
    assert len(found) == 4
    assert "target_layers is [2, 15, 27], expected [1, 14, 26]" in found[0]
    assert "target_hidden_size is 576, the target's hidden size is 64" in found[1]
    assert "norm_before_residual" in found[2] and "offsets + arange" in found[3]


def test_non_default_ids_reach_the_gguf(target, tmp_path):
    """[3, 10, 20] is neither the converter's default nor the nested SGLang ids: only the top-level key we write
    can put [4, 11, 21] in the GGUF."""
    sglang = _sglang_export(target, tmp_path / "sglang", (3, 10, 20), seed=1, sglang_version="before-pr25454")
    nested = json.loads((sglang / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert nested == [3, 10, 20]  # SGLang before PR #25454 adds 1 itself
    info = read_gguf_draft(export_gguf(sglang, target, tmp_path / "out" / "draft.gguf"))
    assert info.target_layers == [4, 11, 21] != [2, LAYERS // 2, LAYERS - 3]
    assert llamacpp_capture_layers(info.target_layers, LAYERS) == [3, 10, 20]


def test_relative_paths_work_as_in_a_workspace_like_runs_demo(target, tmp_path, monkeypatch):
    """The demo's workspace is relative (`runs/demo`); the converter runs in its own stage folder."""
    _sglang_export(target, tmp_path / "ws" / "sglang", (3, 10, 20), seed=1, sglang_version="before-pr25454")
    monkeypatch.chdir(tmp_path)
    out = export_gguf(Path("ws/sglang"), target, Path("ws/export/draft.gguf"))
    assert out.is_file() and read_gguf_draft(out).target_layers == [4, 11, 21]


def test_converter_failure_names_folder_command_and_output(default_ids, target, tmp_path):
    sglang, _, _ = default_ids
    broken = tmp_path / "broken-target"
    broken.mkdir()
    shutil.copy(target / "config.json", broken / "config.json")
    (broken / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": ')  # cut short
    shutil.copy(target / "tokenizer_config.json", broken / "tokenizer_config.json")
    out = tmp_path / "out" / "draft.gguf"
    with pytest.raises(GGUFExportError) as info:
        export_gguf(sglang, broken, out)
    e = info.value
    assert e.folder == sglang and str(sglang) in str(e)
    assert "convert_hf_to_gguf.py" in str(e) and str(broken.resolve()) in " ".join(e.command)
    assert "exited with" in str(e) and e.tail and e.tail in str(e)
    assert "Error" in e.tail  # the converter's traceback, not just an exit code
    assert not out.exists() and list(out.parent.iterdir()) == []


def test_a_corrupted_draft_config_is_refused_before_converting(default_ids, tmp_path):
    sglang, _, _ = default_ids
    copy = Path(shutil.copytree(sglang, tmp_path / "sglang"))
    config = json.loads((copy / "config.json").read_text())
    del config["eagle_config"]
    (copy / "config.json").write_text(json.dumps(config))
    from serving.draft_folder import CheckpointError

    with pytest.raises(CheckpointError, match="eagle_config"):
        export_gguf(copy, tmp_path, tmp_path / "draft.gguf")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_llama_server_drafts_with_the_gguf(default_ids, tmp_path):
    from serving.llamacpp.build import build_tool
    from tasks.model.target import smollm2_gguf_path

    _, gguf, _ = default_ids
    port = _free_port()
    log = tmp_path / "llama-server.log"
    command = [str(build_tool("llama-server")), "-m", str(smollm2_gguf_path()), "-md", str(gguf),
               "--spec-type", "draft-eagle3", "--spec-draft-n-max", "3", "-np", "1", "-c", "2048", "-t", "2",
               "--port", str(port), "--host", "127.0.0.1", "--no-webui"]
    url = f"http://127.0.0.1:{port}"
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=dict(os.environ, LLAMA_ARG_HOST="127.0.0.1"))
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, f"llama-server exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"llama-server not ready:\n{log.read_text()[-3000:]}"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        prompt = "<|im_start|>user\nWrite a short story about a cat.<|im_end|>\n<|im_start|>assistant\n"
        tokens = httpx.post(f"{url}/tokenize", json={"content": prompt, "parse_special": True},
                            timeout=30).json()["tokens"]
        assert len(tokens) > 10
        reply = httpx.post(f"{url}/completion", json={"prompt": tokens, "temperature": 0, "n_predict": 16,
                                                      "return_tokens": True, "cache_prompt": False}, timeout=120)
        reply.raise_for_status()
        body = reply.json()
        timings = body["timings"]
        assert len(body["tokens"]) == body["tokens_predicted"] > 1
        assert timings.get("draft_n", 0) > 0, f"no speculation: {timings}\n{log.read_text()[-3000:]}"
        assert 0 <= timings["draft_n_accepted"] <= timings["draft_n"]
        print(f"llama-server drafted {timings['draft_n']} tokens, accepted {timings['draft_n_accepted']}")
    finally:
        proc.kill()
        proc.wait(timeout=30)
