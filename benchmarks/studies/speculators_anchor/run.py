"""The anchor arm of the recipe study: speculators' trainer on the study's extraction, its draft imported for our
evaluator (the project venv; the training itself runs in `.venv-speculators` as a subprocess).

`train_anchor` converts the extraction once (`<workspace>/anchor/data-<dtype>`, reused while its manifest names
the same vocab and samples), trains into `<workspace>/anchor/<run>` (rerun: speculators resumes), and imports the
last epoch's checkpoint as `<run>/export`: the same weights, with config.json rewritten to the speculators format
our loader and vLLM read (`import_checkpoint`). What the arm keeps of speculators' defaults and what it changes
is `ANCHOR_FLAGS` and docs/results/2026-12-06-recipe-anchor.md.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

from benchmarks.report import ROOT
from benchmarks.studies.speculators_anchor.convert import convert
from storage.datasets import file_sha256, write_folder_atomically

SPECULATORS_PYTHON = ROOT / ".venv-speculators" / "bin" / "python"
TRAIN_SCRIPT = Path(__file__).with_name("train_cpu.py")
HS_DTYPE = "float32"  # the pre-norm stand-in stays exact (convert.py)
TRAIN_DATA_RATIO = 0.99  # it validates on the last rows: 1% here (4 of 344 samples), not its 10%
# Where the anchor departs from speculators' defaults, each for a stated reason:
ANCHOR_FLAGS = [
    "--total-seq-len", "2048",        # ours packs 2,048-token batches; its 8,192 gives 4x fewer steps per epoch
    "--hidden-states-dtype", HS_DTYPE,
    "--no-norm-before-residual",      # its default normalises the residual; our draft layer (and SGLang's) does not
    "--", "--train-data-ratio", str(TRAIN_DATA_RATIO),
]


class AnchorError(RuntimeError):
    """The anchor cannot run or its checkpoint cannot be imported (the message says what to do)."""


def ensure_data(workspace: Path, shards: Path, vocab: Path, target: Path) -> Path:
    """The extraction converted for speculators, once: a folder whose manifest names another vocab or other
    samples is refused, never silently reused."""
    out = workspace / "anchor" / f"data-{HS_DTYPE}"
    if out.exists():
        manifest = json.loads((out / "manifest.json").read_text())
        want = {"vocab_sha256": file_sha256(vocab), "shards": str(shards.resolve()),
                "sample_ids": shard_sample_ids(shards)}
        have = {k: manifest.get(k) for k in want}
        if have != want:
            changed = [k for k in want if have[k] != want[k]]
            raise AnchorError(f"{out} was converted from other data ({', '.join(changed)} differ: the extraction "
                              "grew or changed since); remove it to convert again")
        return out
    t0 = time.monotonic()
    m = convert(shards, vocab, target, out, HS_DTYPE)
    print(f"anchor data: {m['samples']} samples, {m['tokens']:,} tokens ({m['loss_masked_tokens']:,} loss-masked) "
          f"converted in {time.monotonic() - t0:.0f} s -> {out}", flush=True)
    return out


def shard_sample_ids(shards: Path) -> list[str]:
    """The extraction's sample ids in the order convert.py writes them (shard name, then file order)."""
    from safetensors import safe_open

    ids: list[str] = []
    for sf in sorted(shards.glob("*.safetensors")):
        with safe_open(str(sf), "pt") as f:
            ids += json.loads((f.metadata() or {}).get("sample_ids", "[]"))
    return ids


def last_epoch(save: Path) -> Path | None:
    """The newest `epoch<N>_end` checkpoint speculators wrote under `save`, or None."""
    ends = sorted((int(m.group(1)), p) for p in save.glob("epoch*_end") if (m := re.fullmatch(r"epoch(\d+)_end", p.name)))
    return ends[-1][1].resolve() if ends else None


def import_checkpoint(src: Path, dst: Path, aux_layer_ids: list[int], target_num_layers: int,
                      target_embeddings) -> Path:
    """`src` (a speculators checkpoint folder) as a draft folder our loader reads: the draft's weights unchanged,
    config.json with the architecture vLLM's speculators reader names (`Eagle3Speculator`; speculators' own save
    writes `Eagle3DraftModel`) and our record. speculators saves the embeddings it kept frozen; they are dropped
    once checked equal to the target's (`target_embeddings`), as our exports leave them to the target. A
    residual-normalising layer is refused: our draft computes the other one, so the same weights would give
    other logits."""
    from safetensors.torch import load_file, save_file

    from serving.draft_folder import FORMAT, PROJECT_KEY, SPECULATORS_ARCHITECTURE

    cfg = json.loads((src / "config.json").read_text())
    if cfg.get("speculators_model_type") != "eagle3":
        raise AnchorError(f"{src}: not a speculators eagle3 checkpoint")
    if cfg.get("norm_before_residual") is not False:
        raise AnchorError(f"{src}: norm_before_residual is {cfg.get('norm_before_residual')!r}; our draft layer keeps "
                          "the raw residual (train with --no-norm-before-residual)")
    if cfg.get("eagle_aux_hidden_state_layer_ids") != [i + 1 for i in aux_layer_ids]:
        raise AnchorError(f"{src}: layers {cfg.get('eagle_aux_hidden_state_layer_ids')}, the extraction's are "
                          f"{aux_layer_ids} (+1 in speculators' count)")
    weights = load_file(str(src / "model.safetensors"))
    embed = weights.pop("embed_tokens.weight", None)
    if embed is not None and not (embed.shape == target_embeddings.shape
                                  and bool((embed == target_embeddings.to(embed.dtype)).all())):
        raise AnchorError(f"{src}: its embed_tokens differ from the target's; the draft trained them (not frozen)")
    cfg["architectures"] = [SPECULATORS_ARCHITECTURE]
    cfg[PROJECT_KEY] = {"format": FORMAT, "aux_layer_ids": list(aux_layer_ids), "target_num_layers": target_num_layers,
                        "trained_by": f"speculators {cfg.get('speculators_version')}", "checkpoint": str(src)}

    def write(tmp: Path) -> None:
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")

    shutil.rmtree(dst, ignore_errors=True)  # an earlier import of this run: replaced
    write_folder_atomically(dst, write)
    return dst


def target_embeddings(target: Path):
    """The target's input embeddings, from its transformers folder."""
    from safetensors import safe_open

    with safe_open(str(target / "model.safetensors"), "pt") as f:
        return f.get_tensor("model.embed_tokens.weight")


def train_anchor(workspace: Path, run_name: str, *, epochs: int, seed: int, lr: float = 1e-3, threads: int = 2,
                 shards: Path, vocab: Path, target: Path, aux_layer_ids: list[int], target_num_layers: int) -> dict:
    """Train (or resume, or find trained) the anchor run and import its last epoch; the arm's info for the study."""
    if not SPECULATORS_PYTHON.exists():
        raise AnchorError(f"{SPECULATORS_PYTHON} is missing: `make speculators` installs vLLM's trainer there")
    data = ensure_data(workspace, shards, vocab, target)
    save = workspace / "anchor" / run_name
    done_file = save / "anchor.json"
    if done_file.exists():
        return json.loads(done_file.read_text())
    cmd = [str(SPECULATORS_PYTHON), str(TRAIN_SCRIPT), "--data", str(data), "--verifier", str(target),
           "--save-path", str(save), "--epochs", str(epochs), "--lr", str(lr), "--seed", str(seed),
           "--threads", str(threads), "--target-layer-ids", *[str(i + 1) for i in aux_layer_ids], *ANCHOR_FLAGS]
    save.mkdir(parents=True, exist_ok=True)
    resumed = last_epoch(save) is not None
    t0 = time.monotonic()
    with open(save / "train.log", "a") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=save,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    seconds = time.monotonic() - t0
    if proc.returncode != 0:
        raise AnchorError(f"speculators' training exited with {proc.returncode}; see {save / 'train.log'}")
    ckpt = last_epoch(save)
    if ckpt is None:
        raise AnchorError(f"{save}: speculators wrote no epoch checkpoint")
    manifest = json.loads((data / "manifest.json").read_text())
    state = json.loads((ckpt / "training_state.json").read_text())
    info = {"run_name": run_name, "trainer": "speculators", "seed": seed, "steps": state["global_step"],
            "train": {"epochs": epochs, "lr": lr, "flags": ANCHOR_FLAGS, "threads": threads},
            "export": str(import_checkpoint(ckpt, save / "export", aux_layer_ids, target_num_layers,
                                            target_embeddings(target))),
            "exported_step": state["global_step"]}
    if not resumed:  # the whole run in this call: its speed (tokens trained over wall time, startup included)
        info.update(train_s=seconds, train_tok_s=manifest["tokens"] * TRAIN_DATA_RATIO * epochs / seconds)
    done_file.write_text(json.dumps(info, indent=1) + "\n")
    return info
