"""Supervised fine-tuning, top to bottom: conversations -> tokens with assistant-only masks -> one optimizer step
of the policy's Megatron model -> log -> checkpoint; at the end a Hugging Face model that `rl360 train` starts from.

The policy is the RL trainer's (`SFTWorker`, a `PolicyWorker` with the negative log-likelihood as its loss): the
same ranks, layouts, micro-batches, packing, LoRA, offload, checkpoints and export. Conversations stream from
data.train_files (parquet or jsonl, verl's SFT formats: rl360/data/conversations.py), data.batch_size a step;
a resumed run continues from the checkpoint's weights, optimizer and data position, bit for bit.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from rl360.actor.batch import RolloutBatch, build_batch
from rl360.actor.policy_group import PolicyGroup
from rl360.actor.settings import PolicySettings
from rl360.actor.sft import SFTWorker
from rl360.checkpointing import (
    ConvertInfo,
    latest_checkpoint,
    load_checkpoint,
    open_checkpoints,
    save_checkpoint,
    set_previous_run_aside,
)
from rl360.cluster import WorkerGroup, start_ray, stopped_by_signals
from rl360.config import ConfigError, RunConfig, to_dict
from rl360.data.conversations import ConversationTokens, SftKeys, Tokenized
from rl360.data.stream import PromptStream, RowFormat
from rl360.model_dir import check_model_dir
from rl360.run_checks import check_output_paths
from rl360.run_config import check_resume, save_run_config
from rl360.stopping import StopSignals
from rl360.tracking.console import LOG_FILE, RunLog
from rl360.tracking.tracker import Tracker

TOKENS = "_tokens"  # the key under which a streamed row carries its `Tokenized` conversation


class Conversations:
    """data.train_files (or data.val_files) as a stream of batches of tokenized conversations; rows over
    sft.max_length tokens are skipped and counted."""

    def __init__(self, cfg: RunConfig, tokenizer, files: list[str], shuffle: bool, drop_last: bool = True,
                 tokenize: bool = True):
        sft = cfg.sft
        self.tokens = ConversationTokens(tokenizer, SftKeys(sft.messages_key, sft.tools_key, sft.prompt_key,
                                                            sft.response_key))
        self.max_length, self.pad_id = sft.max_length, tokenizer.pad_token_id or 0
        row_format = RowFormat(check_row=self.tokens.check_row, check_columns=self.tokens.check_columns, jsonl=True)
        self.stream = PromptStream(files, cfg.data.batch_size, seed=cfg.seed, shuffle=shuffle,
                                   shuffle_buffer=cfg.data.shuffle_buffer, on_bad_row=cfg.data.on_bad_row,
                                   drop_last=drop_last, filter_fn=self._fits if tokenize else None,
                                   row_format=row_format)

    def _fits(self, row: dict) -> bool:
        source = row["_source"]
        row[TOKENS] = self.tokens(row, source["file"], source["row"])
        return len(row[TOKENS]) <= self.max_length

    def next_batch(self) -> RolloutBatch:
        return self.batch([row[TOKENS] for row in next(self.stream)])

    def batch(self, conversations: list[Tokenized]) -> RolloutBatch:
        return build_batch([c.prompt_ids for c in conversations], [c.response_ids for c in conversations],
                           [[0.0] * len(c.response_ids) for c in conversations], self.pad_id,
                           loss_masks=[c.loss_mask for c in conversations])

    def epoch(self) -> list[RolloutBatch]:
        """Every batch of one pass (the held-out set: in file order, the last batch short)."""
        batches = []
        while self.stream.epoch == 0:
            batches.append(next(self.stream))
        return [self.batch([row[TOKENS] for row in rows]) for rows in batches[:-1]]


def check_sft(cfg: RunConfig) -> Path | None:
    """Before anything slow: the directories the run writes, the model directory, a resume's config changes
    (refused or printed) and every row of the data files (`UserError`s naming what is wrong); the checkpoint to
    resume from, or None."""
    out = Path(cfg.output_dir)
    check_output_paths(cfg, out)
    check_model_dir(cfg.model.path)
    if cfg.validation.every and not cfg.data.val_files:
        raise ConfigError("validation.every measures the held-out loss: give data.val_files (conversations)")
    latest = latest_checkpoint(out / "checkpoints") if cfg.trainer.resume else None
    for line in check_resume(out, cfg, latest) if latest is not None else []:
        print(line, flush=True)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    for files in filter(None, (cfg.data.train_files, cfg.data.val_files)):
        # the format of every row (tokenizing waits for the run)
        stream = Conversations(cfg, tokenizer, files, shuffle=False, drop_last=False, tokenize=False).stream
        while stream.epoch == 0:
            next(stream)
    return latest


def sft(cfg: RunConfig, latest_checked: bool = False) -> Path:
    """Run `cfg.trainer.total_steps` SFT steps; returns the output directory. `latest_checked`: the caller already
    ran `check_sft(cfg)`."""
    started = time.monotonic()
    with stopped_by_signals(Path(cfg.output_dir) / "checkpoints") as stop:
        if not latest_checked:
            check_sft(cfg)
        out = Path(cfg.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        resuming = cfg.trainer.resume and latest_checkpoint(out / "checkpoints") is not None
        notes = [] if resuming else set_previous_run_aside(out, cfg.trainer.resume)
        save_run_config(out, cfg)
        with RunLog(out / LOG_FILE):
            for line in notes:
                print(line, flush=True)
            return _run(cfg, out, stop, started)


def _run(cfg: RunConfig, out: Path, stop: StopSignals, started: float) -> Path:
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    train = Conversations(cfg, tokenizer, cfg.data.train_files, shuffle=cfg.data.shuffle)
    held_out = Conversations(cfg, tokenizer, cfg.data.val_files, shuffle=False, drop_last=False).epoch() \
        if cfg.data.val_files else []
    ranks = cfg.actor.parallel.ranks
    gpus = start_ray(cfg.cluster.ray_address, cfg.cluster.num_cpus or ranks, cfg.cluster.num_gpus)
    stop.install()  # again: ray.init replaced the SIGTERM handler with its own
    if 0 < gpus < ranks:
        raise ConfigError(f"actor.parallel asks for {ranks} ranks; the cluster has {gpus} GPUs")
    policy = PolicyGroup(WorkerGroup(SFTWorker, ranks, PolicySettings.of(cfg), name="policy", use_gpu=gpus > 0,
                                     timeout_s=cfg.cluster.placement_timeout_s))
    print(f"policy: {ranks} rank(s), {policy.dp_size} data-parallel replica(s)", flush=True)  # once they are built
    checkpoints = out / "checkpoints"
    resumed = open_checkpoints(checkpoints, cfg.trainer.resume)
    first_step = 1
    if resumed is not None:  # weights, optimizer state, data position
        state = load_checkpoint(resumed, {"policy": policy})
        train.stream.load_state_dict(state["data"])
        first_step = state["step"] + 1
        print(f"resumed from {resumed} at step {first_step}", flush=True)
    tracker = Tracker(out, to_dict(cfg), cfg.tracking.wandb, cfg.tracking.project, cfg.tracking.run_name,
                      cfg.tracking.log_every, resume_after_step=first_step - 1 if resumed else None,
                      total_steps=cfg.trainer.total_steps, started=started, use_swanlab=cfg.tracking.swanlab,
                      use_tensorboard=cfg.tracking.tensorboard)
    parallel = cfg.actor.parallel

    def save(step: int) -> Path:
        return save_checkpoint(checkpoints, step, {"policy": policy}, {"data": train.stream.state_dict()},
                               cfg.trainer.keep_checkpoints, ConvertInfo(cfg.model.path, parallel.tensor,
                                                                         parallel.pipeline, cfg.model.dtype))

    done = first_step - 1
    try:
        for step in range(first_step, cfg.trainer.total_steps + 1):
            if stop.requested:
                break
            began = time.perf_counter()
            # 1. a batch of conversations, tokenized with assistant-only loss masks
            batch = train.next_batch()
            # 2. one optimizer step over it (every data-parallel replica its share)
            metrics = _merge(policy.shard_call("update", batch))
            seconds = time.perf_counter() - began
            tokens = int(batch.sequence_lengths().sum())
            metrics.update({"sft/tokens": tokens, "sft/trained_tokens": int(batch.response_mask.sum()),
                            "sft/tokens_per_s": tokens / seconds, **_skipped(train.stream)})
            # 3. the held-out loss when due, then log
            every = cfg.validation.every
            if held_out and every and (step % every == 0 or step == cfg.trainer.total_steps):
                metrics["val/loss"] = held_out_loss(policy, held_out)
            metrics["timing/step_s"] = time.perf_counter() - began
            tracker.log(step, metrics)
            done = step
            # 4. a resumable checkpoint now and then, and at the end
            if cfg.trainer.save_every and (step % cfg.trainer.save_every == 0 or step == cfg.trainer.total_steps):
                save(step)
        if done < cfg.trainer.total_steps:  # stopped by a signal: a checkpoint of the last step completed
            latest = latest_checkpoint(checkpoints)
            if done >= first_step and (latest is None or latest.name != f"step_{done:06d}"):
                latest = save(done)
            raise stop.stopped(done, latest)
        if cfg.trainer.save_hf:
            policy.save_hf(str(out / "hf"))
            tokenizer.save_pretrained(str(out / "hf"))
    finally:
        tracker.close()
    return out


def held_out_loss(policy: PolicyGroup, batches: list[RolloutBatch]) -> float:
    """The negative log-likelihood per assistant token of the held-out conversations."""
    total = count = 0.0
    for batch in batches:
        size = len(batch) - len(batch) % policy.dp_size  # the data-parallel replicas take equal shares
        if size:
            part = batch.select(slice(0, size))
            logprobs = torch.cat(policy.shard_call("compute_logprobs", part))
            total -= float((logprobs * part.response_mask).sum())
            count += float(part.response_mask.sum())
        if size < len(batch):  # the rest on the first replica alone
            rest = batch.select(slice(size, len(batch)))
            logprobs = policy.call("compute_logprobs", rest)
            logprobs = next(value for value in logprobs if value is not None)
            total -= float((logprobs * rest.response_mask).sum())
            count += float(rest.response_mask.sum())
    return total / max(count, 1.0)


def _merge(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Each replica's share of the step's loss adds up; the gradient norm is the same on every rank."""
    same = ("sft/grad_norm", "sft/update_skipped")
    return {key: per_rank[0][key] if key in same else sum(m[key] for m in per_rank) for key in per_rank[0]}


def _skipped(stream: PromptStream) -> dict[str, int]:
    skipped = stream.skipped()
    return {"sft/rows_too_long": skipped["filtered"], "sft/bad_rows_skipped": skipped["bad_rows"],
            "sft/epoch": stream.epoch}
