"""The training loop: the EAGLE-3 draft trained on each round of extracted shards (or online), resumable.

Owns one training run's work, callable without Prefect (the `train` flow and torchrun's other
ranks call `run_training`): the run's identity and resume from its last checkpoint, each round
(the shards extraction wrote and this run has not trained on, or every generation in online mode),
its epochs and optimizer steps, metrics, checkpoints, the serving exports at the end of each round
(`export_formats`: SGLang, speculators, llama.cpp GGUF) and the deletion of the round's consumed
shards. Promises: a resumed run continues at the micro-batch where its checkpoint stopped and
refuses a changed identity (extraction, vocab, draft shape, seed, batch geometry); metrics are
written before the checkpoint that covers them; under torchrun every process runs the same steps
and rank 0 alone writes lineage, checkpoints and exports.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from serving.llamacpp.export import GGUF_FILE, export_gguf, llamacpp_converter, target_folder_for
from storage.datasets import file_sha256
from storage.lineage import LineageError, LineageStore
from storage.shards import ShardStore
from tasks.config import TrainConfig
from serving.sglang.export import export_sglang
from serving.vllm.export import export_speculators
from tasks.extract.chat import Sample
from tasks.extract.hf_backend import ExtractSettings, build_extractor
from tasks.extract.plan import delete_consumed_shards
from tasks.extract.vocab import load_vocab
from tasks.model.draft import (DraftConfig, Eagle3Draft, init_head_from_target, load_target_embeddings,
                               target_final_norm_weight, target_head_weight)
from tasks.model.target import load_configured_target
from tasks.train.data import ONLINE, RoundReader, online_samples as load_online_samples
from tasks.train.steps import (DataPosition, Item, Schedule, TrainState, epoch_batches, list_checkpoints,
                               load_checkpoint, make_optimizer, micro_batch_index, save_checkpoint, step_groups,
                               train_step, weights_sha256)
from tasks.train.ttt import collate
from tasks.train.validation import (Validation, best_folders, keep_if_best, load_best, split_validation, validate,
                                    validation_batches)


@dataclass
class TrainSummary:
    run_name: str
    run_id: str = ""
    mode: str = "offline"
    resumed_from_step: int | None = None
    steps_this_run: int = 0
    step: int = 0
    rounds_done: int = 0
    tokens: int = 0
    last_loss: float | None = None
    last_accuracy: list[float] = field(default_factory=list)
    last_conditional_accuracy: list[float] = field(default_factory=list)
    skipped_micro_batches: int = 0  # online: micro-batches whose samples were all quarantined (not trained)
    quarantined_samples: int = 0    # online: samples the extractor quarantined (left out of their micro-batch)
    shards_trained: int = 0
    shards_deleted: int = 0
    stopped_by: str = "done"  # done | no_data | max_steps
    checkpoint: str | None = None
    exports: dict[str, str] = field(default_factory=dict)
    export_seconds: dict[str, float] = field(default_factory=dict)
    curves_png: str | None = None
    validations: list[dict] = field(default_factory=list)  # rank 0: the run's, every invocation's, by round and step
    exported_step: int | None = None  # the step of the draft the last round exported (the best validated one)
    exported_expected_acceptance: float | None = None
    seconds: float = 0.0  # this invocation's
    tokens_this_run: int = 0  # trained positions of this invocation: over `seconds`, its speed, resumed or not
    world_size: int = 1


@dataclass
class Dist:
    rank: int = 0
    world_size: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_reduce(self, t: torch.Tensor) -> None:
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM)

    def barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier()


def dist_from_env() -> Dist:
    """torchrun's environment, process group initialised (gloo on CPU, nccl on CUDA); one process otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist()
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return Dist(torch.distributed.get_rank(), world)


def run_training(config: TrainConfig, store: LineageStore, run_id: str, dist: Dist, logger,
                 progress: Callable[[float], None] | None = None) -> TrainSummary:
    """Train (or continue training) the named draft on every round of shards left (online: one round).

    Rank 0 alone writes lineage, checkpoints and exports; `progress` gets the round's percent done.
    """
    started = time.monotonic()
    ws = Path(config.workspace)
    summary = TrainSummary(run_name=config.run_name, run_id=run_id, mode=config.mode, world_size=dist.world_size)
    found = store.extraction.settings(config.extract_key)
    if found is None:
        raise LineageError("no extraction in this workspace" + (f" with key {config.extract_key}" if config.extract_key else "")
                           + ": run `eagle3 extract` first (it builds the draft vocab the draft is trained for)")
    ekey, settings = found["extract_key"], found["settings"]
    vocab_path = ws / found["vocab_file"]
    if file_sha256(vocab_path) != found["vocab_sha256"]:
        raise LineageError(f"draft vocab {vocab_path} does not match its recorded sha256")
    vocab = load_vocab(vocab_path)
    t = config.target
    model, tokenizer, identity = load_configured_target(t.gguf, t.model_path, t.revision, t.trust_remote_code, t.dtype,
                                                        t.device)
    if (identity.name, identity.revision) != (settings["target"], settings["target_revision"]):
        raise LineageError(f"extraction {ekey} was made with target {settings['target']}@{settings['target_revision']}, "
                           f"but train.target is {identity.name}@{identity.revision}")
    device = model.device
    aux_ids = settings["aux_layer_ids"]
    dcfg = DraftConfig.from_target_config(model.config, vocab.draft_vocab_size, aux_ids,
                                          norm_before_fc=config.norm_before_fc, norm_output=config.norm_output)
    torch.manual_seed(config.seed)
    draft = Eagle3Draft(dcfg).to(device)
    load_target_embeddings(draft, model)
    draft.set_vocab(vocab.d2t, vocab.t2d)
    target_head = target_head_weight(model)
    if config.init == "target_head":  # a resumed run's checkpoint replaces these below
        init_head_from_target(draft, target_head, target_final_norm_weight(model))
    if config.head == "frozen":  # before the optimizer is made: it holds only what trains
        draft.lm_head.weight.requires_grad_(False)
    optimizer = make_optimizer(draft, config.lr, config.weight_decay, config.optimizer)
    schedule = Schedule(config.lr, config.schedule, config.warmup_steps, config.total_steps, config.min_lr_ratio)
    # What must not change under a resumed run (the split of micro-batches over processes may).
    run_identity = {"run_name": config.run_name, "mode": config.mode, "extract_key": ekey, "vocab_id": found["vocab_id"],
                    "draft_config": dcfg.to_dict(), "seed": config.seed, "batch_tokens": config.batch_tokens,
                    "micro_batches_per_step": dist.world_size * config.grad_accum, "ttt_steps": config.ttt_steps,
                    "step_decay": config.step_decay}
    # Added only when set, so that runs begun before these options existed still resume.
    if config.head != "trained":
        run_identity["head"] = config.head
    if config.optimizer != "adamw":
        run_identity["optimizer"] = config.optimizer
    if config.loss_positions != "argmax_in_draft":
        run_identity["loss_positions"] = config.loss_positions
    if config.validation_samples:
        run_identity["validation_samples"] = config.validation_samples
    if dist.main:
        stored = store.training.register_run(run_id, {
            "run_name": config.run_name, "mode": config.mode, "extract_key": ekey, "vocab_id": found["vocab_id"],
            "target": identity.name, "target_revision": identity.revision, "draft_config": dcfg.to_dict(),
            "train_config": config.model_dump(mode="json")})
        if stored["extract_key"] != ekey:
            raise LineageError(f"training run {config.run_name!r} trains on extraction {stored['extract_key']}, not {ekey}; "
                               "pick another run_name")
    ckpt_root = ws / "checkpoints" / config.run_name
    state = TrainState()
    existing = list_checkpoints(ckpt_root)
    if existing:
        state = load_checkpoint(existing[-1], draft, optimizer, run_identity)
        summary.resumed_from_step = state.step
        logger.info("resumed %s from %s (step %d)", config.run_name, existing[-1].name, state.step)
    tokens_at_start = state.tokens

    shard_store = ShardStore(ws / "shards", 1 << 62)  # reading only: the budget is extract's concern
    online_samples: list[Sample] | None = None
    extractor = None
    if config.mode == "online":
        online_samples = load_online_samples(store, ws, tokenizer, identity.chat_template, settings)
        ext_settings = ExtractSettings(aux_layer_ids=aux_ids, teacher=settings["teacher"], topk=settings["topk"],
                                       storage="bf16")
        extractor = build_extractor("hf", model, tokenizer, ext_settings, torch.from_numpy(vocab.t2d), config.batch_tokens)

    def checkpoint() -> None:
        if dist.main:
            # Metrics first: a kill between the two then leaves rows for steps the resume redoes (and
            # replaces, keyed by step), never a checkpoint whose steps' rows were lost.
            store.training.write_metrics(run_id, config.run_name, pending_metrics)
            pending_metrics.clear()
            summary.checkpoint = str(save_checkpoint(ckpt_root, draft, optimizer, state, run_identity,
                                                     config.keep_checkpoints))
        dist.barrier()

    pending_metrics: list[dict] = []
    while True:
        if state.position is None:
            if config.mode == "online":
                shards = []  # online: each invocation trains one round over every generation
            else:
                rows = store.extraction.round_shards(ekey, config.run_name, state.trained_shards,
                                                     config.replay_kept_shards)
                if not rows:
                    summary.stopped_by = "done" if summary.steps_this_run else "no_data"
                    break
                shards = [r["shard"] for r in rows]
            state.position = DataPosition(round_index=state.rounds_done, shards=shards)
        pos = state.position
        if config.mode == "online":
            items = [Item(ONLINE, i, s.num_tokens) for i, s in enumerate(online_samples or [])]
            reader = RoundReader(None, {}, online_samples, extractor)
        else:
            rows = {r["shard"]: r for r in store.extraction.round_shards(
                ekey, config.run_name, state.trained_shards, config.replay_kept_shards)}
            lost = [s for s in pos.shards if s not in rows]
            if lost:
                raise LineageError(f"{len(lost)} shard(s) of round {pos.round_index} are gone (e.g. {lost[0]}); "
                                   "they were deleted before this run finished the round")
            items = [Item(s, slot, n) for s, slot, n in store.extraction.shard_samples(pos.shards)]
            mark = (lambda name, epoch: store.extraction.mark_shards_read(config.run_name, [name], epoch)) if dist.main else None
            reader = RoundReader(shard_store, rows, on_first_read=mark)
        if not items:
            summary.stopped_by = "no_data"
            state.position = None
            break
        items, held_out = split_validation(items, config.validation_samples, config.seed, pos.round_index)
        validator = None
        if held_out:
            # read once, without marking shards consumed (training's own reads do that)
            plain = RoundReader(shard_store, rows) if config.mode != "online" else reader
            val_batches = validation_batches([r for it in held_out for r in plain.records([it], 0)],
                                             config.batch_tokens)
            validator = _validator(config, draft, val_batches, target_head, ckpt_root, pos.round_index, state,
                                   store, run_id, dist, logger)
        if config.schedule != "constant" and config.total_steps is None:
            # One cycle per round (warmup, then a cosine or linear decay over all its epochs): each round's
            # export is a decayed draft, and a round extracted later trains at full lr again rather than at
            # the floor. The cycle is kept in the checkpoints, so a resumed round keeps its own.
            if state.lr_horizon is None:
                state.lr_start = state.step
                state.lr_horizon = state.step + sum(
                    step_groups(len(epoch_batches(items, config.seed, pos.round_index, e, config.batch_tokens)),
                                dist.world_size, config.grad_accum) for e in range(pos.epoch, config.epochs))
                logger.info("round %d: %s schedule over optimizer steps %d-%d", pos.round_index, config.schedule,
                            state.lr_start, state.lr_horizon)
            schedule = dataclasses.replace(schedule, start_step=state.lr_start, total_steps=state.lr_horizon)
        stopped = _train_round(config, draft, optimizer, schedule, target_head, reader, items, state, dist, summary,
                               pending_metrics, checkpoint, progress if dist.main else None, logger, validator)
        if stopped:
            summary.stopped_by = "max_steps"
            break
        # the round is complete: record it, checkpoint, export, free its shards
        state.rounds_done += 1
        state.trained_shards += pos.shards
        state.position = None
        state.lr_horizon = None  # the next round starts its own cycle
        checkpoint()
        if dist.main:
            store.training.write_round(run_id, config.run_name, pos.round_index, pos.shards, len(items), config.epochs,
                                    state.step)
            exported = draft
            summary.exported_step, summary.exported_expected_acceptance = state.step, None
            if validator is not None and best_folders(ckpt_root, pos.round_index):  # the round's best, not its last
                exported = copy.deepcopy(draft)
                best = load_best(ckpt_root, pos.round_index, exported)
                summary.exported_step, summary.exported_expected_acceptance = best.step, best.expected_acceptance
                logger.info("round %d: exporting the draft of step %d (expected acceptance %.3f on %d held-out "
                            "samples), trained to step %d", pos.round_index, best.step, best.expected_acceptance,
                            best.samples, state.step)
            export_round(config, exported, store, run_id, summary, state, ekey, found["vocab_id"], identity, aux_ids,
                         ckpt_root, logger, step=summary.exported_step)
            summary.shards_trained += len(pos.shards)
            if config.delete_consumed and pos.shards:
                summary.shards_deleted += len(delete_consumed_shards(store, shard_store, pos.shards))
        dist.barrier()
        if config.mode == "online":
            break
    if summary.stopped_by == "max_steps":
        checkpoint()
    summary.step, summary.rounds_done, summary.tokens = state.step, state.rounds_done, state.tokens
    summary.tokens_this_run = state.tokens - tokens_at_start
    if dist.main:
        summary.validations = store.training.validations(config.run_name)
    summary.seconds = time.monotonic() - started
    return summary


def _validator(config: TrainConfig, draft: Eagle3Draft, batches, target_head: torch.Tensor, ckpt_root: Path,
               round_index: int, state: TrainState, store: LineageStore, run_id: str, dist: Dist, logger
               ) -> Callable[[int], Validation | None]:
    """Measure the draft on the round's held-out samples, record the validation in the lineage store and keep the
    draft when it is the round's best (rank 0)."""
    def run(epoch: int) -> Validation | None:
        if not dist.main:
            return None
        v = validate(draft, batches, ttt_steps=config.ttt_steps, target_head=target_head, step=state.step,
                     epoch=epoch)
        kept = keep_if_best(ckpt_root, round_index, draft, v)
        store.training.write_validation(run_id, config.run_name, round_index, v.to_json(), kept)
        logger.info("validation at step %d: expected acceptance %.3f (acc %s)%s", v.step, v.expected_acceptance,
                    " ".join(f"{a:.3f}" for a in v.conditional_accuracy), ", the best so far" if kept else "")
        return v
    return run


def _train_round(config: TrainConfig, draft: Eagle3Draft, optimizer, schedule: Schedule, target_head: torch.Tensor,
                 reader: RoundReader, items: list[Item], state: TrainState, dist: Dist, summary: TrainSummary,
                 pending_metrics: list[dict], checkpoint, progress: Callable[[float], None] | None,
                 logger=None, validator: Callable[[int], Validation | None] | None = None) -> bool:
    """The remaining epochs of the current round; True if max_steps stopped it.

    Online, a micro-batch whose samples the extractor all quarantined is skipped (an empty slot),
    counted in `summary.skipped_micro_batches` and logged; a step left with no micro-batch at all
    makes no optimizer step on one process (under torchrun it still joins the reductions with zeros).
    """
    logger = logger or logging.getLogger(__name__)
    pos = state.position
    assert pos is not None
    accum, world = config.grad_accum, dist.world_size
    all_reduce = dist.all_reduce if world > 1 else None
    validate_every = config.validate_every or config.checkpoint_every
    pad = 0
    for epoch in range(pos.epoch, config.epochs):
        batches = epoch_batches(items, config.seed, pos.round_index, epoch, config.batch_tokens)
        n_steps = step_groups(len(batches), world, accum)
        with Progress(TextColumn(f"train round {pos.round_index} epoch {epoch}"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("{task.fields[info]}"), TimeRemainingColumn(), transient=True,
                      disable=not dist.main) as bar:
            job = bar.add_task("train", total=n_steps, completed=pos.step_in_epoch, info="")
            for s in range(pos.step_in_epoch, n_steps):
                micro = []
                quarantined_before = reader.quarantined
                for a in range(accum):
                    idx = micro_batch_index(s, a, dist.rank, world, accum)
                    records = reader.records(batches[idx], epoch) if idx < len(batches) else None
                    if records is not None and not records:  # online: every sample of it was quarantined
                        summary.skipped_micro_batches += 1
                        logger.warning("round %d epoch %d step %d: micro-batch %d skipped, its %d sample(s) were "
                                       "all quarantined by the extractor", pos.round_index, epoch, s, idx,
                                       len(batches[idx]))
                    micro.append(collate(records, pad) if records else None)
                summary.quarantined_samples += reader.quarantined - quarantined_before
                if world == 1 and all(b is None for b in micro):
                    # nothing to train on in this step: no optimizer step (the schedule does not move)
                    pos.step_in_epoch = s + 1
                    bar.update(job, completed=s + 1, info="skipped: all quarantined")
                    continue
                # An empty slot adds nothing; under torchrun every process still joins the reductions.
                m = train_step(draft, optimizer, micro, None, ttt_steps=config.ttt_steps, decay=config.step_decay,
                               target_head=target_head, lr=schedule.lr_at(state.step), grad_clip=config.grad_clip,
                               precision=config.precision, all_reduce=all_reduce,
                               loss_positions=config.loss_positions)
                state.step += 1
                state.tokens += m.tokens
                pos.step_in_epoch = s + 1
                summary.steps_this_run += 1
                summary.last_loss, summary.last_accuracy = m.loss, m.accuracy
                summary.last_conditional_accuracy = m.conditional_accuracy
                if state.step % config.log_every == 0 or s + 1 == n_steps:
                    pending_metrics.append({"step": state.step, "round": pos.round_index, "epoch": epoch, "lr": m.lr,
                                            "loss": m.loss, "step_loss": m.step_loss, "accuracy": m.accuracy,
                                            "conditional_accuracy": m.conditional_accuracy, "tokens": state.tokens,
                                            "grad_norm": m.grad_norm})
                bar.update(job, completed=s + 1, info=f"loss {m.loss:.3f} acc0 {m.accuracy[0]:.3f}")
                if progress is not None:
                    progress(100.0 * (epoch * n_steps + s + 1) / (config.epochs * n_steps))
                if config.max_steps is not None and state.step >= config.max_steps:
                    return True
                # a validation comes before the checkpoint of its step: a resumed run never skips one
                end_of_epoch = s + 1 == n_steps
                if validator is not None and (end_of_epoch or state.step % validate_every == 0):
                    validator(epoch)
                if state.step % config.checkpoint_every == 0:
                    checkpoint()
        pos.epoch, pos.step_in_epoch = epoch + 1, 0
    return False


def export_round(config: TrainConfig, draft: Eagle3Draft, store: LineageStore, run_id: str, summary: TrainSummary,
            state: TrainState, ekey: str, vocab_id: str, identity, aux_ids: list[int], ckpt_root: Path, logger,
                 step: int | None = None) -> None:
    """The configured serving formats of the draft at the end of a round, each registered with its lineage.

    Each is a folder `export/<format>-step-N`, N the optimizer step of the exported weights (`step`: the
    round's best validated draft; default the last); gguf's holds one file, converted from the sglang folder.
    """
    step = state.step if step is None else step
    verifier = config.target.model_path or identity.name
    folders: dict[str, Path] = {}
    for fmt in ("sglang", "speculators", "gguf"):
        if fmt not in config.export_formats:
            continue
        folder = ckpt_root / "export" / f"{fmt}-step-{step:08d}"
        if folder.exists():
            shutil.rmtree(folder)  # the same step exported again after a crash: rewrite it
        started = time.monotonic()
        converter = None
        if fmt == "sglang":
            export_sglang(draft, folder)
        elif fmt == "speculators":
            export_speculators(draft, folder, verifier)
        else:
            t = config.target
            target_folder = target_folder_for(t.gguf, t.model_path, t.revision, t.dtype)
            export_gguf(folders["sglang"], target_folder, folder / GGUF_FILE, outtype=config.gguf_outtype,
                        aux_layer_ids=aux_ids)
            converter = llamacpp_converter()[1]
        seconds = time.monotonic() - started
        sha = file_sha256(folder / GGUF_FILE) if fmt == "gguf" else weights_sha256(folder)
        name = f"{config.run_name}/{fmt}-step-{step:08d}"
        store.checkpoints.register(run_id, {
            "checkpoint": name, "run_name": config.run_name, "step": step, "format": fmt, "path": str(folder),
            "sha256": sha, "rounds": state.rounds_done, "target": identity.name,
            "target_revision": identity.revision, "aux_layer_ids": aux_ids, "vocab_id": vocab_id, "extract_key": ekey,
            "converter": converter})
        folders[fmt] = folder
        summary.exports[fmt] = str(folder.resolve())
        summary.export_seconds[fmt] = round(seconds, 2)
        logger.info("exported %s (%s) in %.1f s", name, fmt, seconds)
