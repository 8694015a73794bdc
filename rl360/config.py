"""Typed run configuration: YAML read by OmegaConf into dataclasses, with `key=value` overrides.

Every knob has a default and a one-line comment. An unknown key or a value outside its allowed set is a
`ConfigError` that names the key (and the allowed values).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import sys
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import (
    ConfigKeyError,
    InterpolationResolutionError,
    OmegaConfBaseException,
    ValidationError,
)

from megatron_bridge.layer_spec import ATTENTION_CHOICES
from megatron_bridge.lora import expand_targets
from rl360.algos.advantages import get_advantage_estimator
from rl360.algos.losses import AGG_MODES, KL_ESTIMATORS, ROLLOUT_IS_LEVELS, get_policy_loss
from rl360.core.engine_kinds import either, engine_kind, engine_names, engine_summaries
from rl360.core.trajectory import TRAJECTORY_ENDINGS
from rl360.errors import ConfigError
from rl360.tracking.backends import missing_package
from rl360.weight_sync.registry import get_strategy, strategies, strategy_summaries, usable_strategies


@dataclass
class ModelConfig:
    path: str = ""  # Hugging Face model directory (config.json, safetensors, tokenizer)
    dtype: str = "float32"  # trainer parameter dtype: float32 | bfloat16
    # the Megatron model's layer spec: auto (torch, until Transformer Engine's spec has passed the GPU device
    # checks), te (megatron's Transformer Engine spec), torch (our core attention on torch's attention kernels)
    # or local (megatron's unfused attention, the whole score matrix in memory; no packing, no context parallelism)
    attention: str = "auto"
    # vision-language models: bounds on each image's resized area in pixels (0: the model's image processor's own)
    min_pixels: int = 0
    max_pixels: int = 0


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)  # parquet files, directories or globs (rl360 sft: jsonl too)
    batch_size: int = 16  # prompts per RL step (each sampled rollout.n times)
    max_prompt_length: int = 512  # prompts longer than this (in tokens) are skipped and counted
    shuffle: bool = True  # seeded per-epoch shuffle of row groups and rows
    shuffle_buffer: int = 1024  # rows held in the shuffle buffer
    on_bad_row: str = "error"  # error | skip: what a malformed row does
    mix_weights: dict[str, float] = field(default_factory=dict)  # data_source prefix -> sampling weight
    # held-out parquet files (rows as in train_files) evaluated during training: validation.every, docs/eval.md
    val_files: list[str] = field(default_factory=list)


@dataclass
class RolloutConfig:
    # the rollout engines' kind (rl360/core/engine_kinds.py)
    engine: str = "hf"
    n: int = 8  # responses sampled per prompt
    temperature: float = 1.0  # sampling temperature (the trainer scores with the same one)
    top_p: float = 1.0  # nucleus sampling
    top_k: int = -1  # top-k sampling; -1 disables
    max_response_length: int = 256  # new tokens per response
    # tokens (their text, each one token of the tokenizer) that end a response, or an agent's turn, as the
    # end-of-turn token does, e.g. an answer token after which nothing more counts
    stop_tokens: list[str] = field(default_factory=list)
    # strings that end a response, or an agent's turn, at the token whose text completes one (that token kept;
    # any number of tokens, e.g. "</answer>"): SGLang's `stop`, for every engine
    stop: list[str] = field(default_factory=list)
    num_engines: int = 1  # engines the fleet spreads each step's prompts over
    # how weights reach server/sglang engines after an update (rl360/weight_sync: one module per strategy)
    weight_sync: str = "distributed"
    # engines on the trainer's GPUs: server/sglang (sync mode) release their weights and KV cache while the
    # trainer trains and take them back for the weight update; hf shares policy rank 0's GPU. Unset (null):
    # colocated exactly when the cluster has too few GPUs for separate engines (rl360/cluster/placement.py)
    colocate: bool | None = None
    # sync: generate, then train; async: generate the next steps while step k trains (up to max_staleness ahead)
    mode: str = "sync"
    max_staleness: int = 1  # async: steps generated ahead, so trained responses are at most this many updates old
    # async: a weight update aborts requests in flight and continues them under the new weights (tokens tagged
    # with their version) instead of waiting for them (server/sglang engines; an agent's cut turn goes on the same
    # way and stays one turn)
    partial: bool = False
    request_timeout_s: float = 600.0  # an engine that answers no generate request in this long is restarted
    startup_timeout_s: float = 300.0  # an engine process must serve within this long
    max_engine_restarts: int = 8  # restarts in a run before a failing engine stops the run
    engine_tensor_parallel: int = 1  # sglang: --tp-size of each engine (GPUs per engine)
    mem_fraction: float = 0.8  # sglang: --mem-fraction-static
    engine_args: list[str] = field(default_factory=list)  # more command-line arguments for each engine process
    # server/sglang: where engine processes run: local (the trainer's node, on 127.0.0.1) or ray (each in a Ray
    # actor reserving engine_tensor_parallel GPUs on a node Ray picks, serving on that node's address)
    engine_hosts: str = "local"
    # server/sglang: how generate requests reach the engines: fleet (the fleet sends each engine its share) or
    # sglang (through sglang-router, `pip install 'rl360[router]'`, which the fleet starts on 127.0.0.1 in front
    # of its engines; weight updates, pauses and restarts still go to each engine from the fleet, and an engine
    # joins the router only while it serves the current weights)
    router: str = "fleet"
    # sglang-router's --policy: cache_aware (a prompt to the engine holding its prefix, unless loads differ too
    # much), round_robin, random or power_of_two
    router_policy: str = "cache_aware"


@dataclass
class ParallelConfig:
    tensor: int = 1  # tensor-parallel size
    pipeline: int = 1  # pipeline-parallel size
    # virtual pipeline stages: each pipeline rank holds this many non-adjacent chunks of layers and megatron's
    # interleaved schedule runs them, which shrinks the pipeline bubble by this factor (needs pipeline > 1,
    # layers divisible by pipeline x virtual_pipeline, and at least `pipeline` micro-batches per mini-batch)
    virtual_pipeline: int = 1
    # context-parallel size: each sequence split over this many ranks (attention gathers keys and values),
    # for responses too long for one rank's activations; needs model.attention=auto, te or torch
    context: int = 1
    # Transformer Engine's context-parallel attention (model.attention=te): p2p (keys and values passed around a
    # ring, overlapped with compute), all_gather or a2a (heads scattered, Ulysses); torch's attention all-gathers
    cp_comm_type: str = "p2p"
    # sequence parallelism (with tensor > 1): norms and residuals on 1/tensor of the tokens each, all-gathered
    # before and reduce-scattered after the tensor-parallel blocks instead of all-reduced
    sequence: bool = False
    data: int = 1  # data-parallel size (policy ranks = tensor * pipeline * context * data)
    # expert-parallel size (mixture-of-experts models): each rank holds 1/expert of every layer's routed experts,
    # tokens sent to them by all-to-all; the EP ranks are taken from data x context (it must divide that, and
    # config.json's num_experts); no extra ranks
    expert: int = 1

    @property
    def ranks(self) -> int:
        return self.tensor * self.pipeline * self.context * self.data


@dataclass
class LoraConfig:
    # LoRA adapters of this rank on the decoder's linears (0: off, the whole model trains); only the adapters
    # train, sit in the optimizer and in checkpoints, the base weights come from model.path (docs/lora.md)
    rank: int = 0
    alpha: float = 16.0  # adapter output scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapters' input (PEFT's lora_dropout)
    # HF projection names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj) or all-linear
    targets: list[str] = field(default_factory=lambda: ["all-linear"])


@dataclass
class ActorConfig:
    lr: float = 1e-6  # Adam learning rate
    weight_decay: float = 0.0  # AdamW weight decay
    betas: tuple[float, float] = (0.9, 0.999)  # Adam betas
    grad_clip: float = 1.0  # clip the global grad norm to this (0 disables)
    ppo_mini_batch_size: int = 16  # prompts per optimizer step (x rollout.n responses)
    micro_batch_size: int = 8  # responses per forward/backward pass
    # > 0: micro-batches sized by tokens instead: rows longest first, as many as fit in this many padded tokens
    # (rows x the longest row), each cut to its longest row; micro_batch_size is then unused
    max_tokens_per_micro_batch: int = 0
    recompute: str = "none"  # activation recomputation: none | selective (core attention) | full (every layer)
    # micro-batches as one packed row (thd: sequences back to back, no padding; not with model.attention=local),
    # max_tokens_per_micro_batch then counts real tokens
    pack_sequences: bool = False
    freeze_vision_tower: bool = False  # vision-language models: the vision tower (merger included) stays as loaded
    # mixture-of-experts models: weight of megatron's router load-balancing loss (0: off; config.json's
    # router_aux_loss_coef is not used: RL fine-tunes an already balanced router)
    moe_aux_loss_coef: float = 0.0
    # mixture-of-experts models: the engines return the experts each token was routed to and the trainer's routers
    # replay them in the log-prob and update passes (docs/moe-routing-replay.md; SGLang needs
    # --enable-return-routed-experts, which rl360 adds to the engines it starts)
    moe_routing_replay: bool = False
    # ZeRO-1 (megatron's distributed optimizer): the fp32 main weights and Adam moments are split over the
    # data-parallel ranks; gradients are reduce-scattered and each rank's updated slice all-gathered after a step
    distributed_optimizer: bool = False
    # optimizer state, gradients and the reference model in host memory outside the calls that use them (an
    # update; reference log-probs), and the weights too between calls when rollout.colocate (rl360/actor/offload.py)
    offload: bool = False
    ppo_epochs: int = 1  # passes over each step's rollouts
    clip_ratio_low: float | None = None  # clip: ratio >= 1 - this (None: the loss's default, 0.2; gspo: 3e-4)
    clip_ratio_high: float | None = None  # clip: ratio <= 1 + this (None: 0.2; gspo: 4e-4; DAPO clip-higher: 0.28)
    clip_ratio_c: float = 0.0  # dual clip: loss of negative advantages at most -A * c (0: off; usual 3.0)
    loss_mode: str = "vanilla"  # policy loss: vanilla (PPO clip) | gspo | gspo_token | gpg | "pkg.mod:fn"
    loss_agg_mode: str = "token-mean"  # token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm
    entropy_coeff: float = 0.0  # weight of the entropy bonus (subtracted from the loss)
    rollout_correction: str = "none"  # none | tis (truncated IS weights) | mask (drop tokens outside range)
    rollout_is_threshold: float = 2.0  # upper bound C of pi_old / pi_engine (tis: cap; mask: keep <= C)
    rollout_is_threshold_lower: float = 0.0  # mask: keep ratios >= this (0: 1 / rollout_is_threshold)
    rollout_is_level: str = "token"  # ratio per token | sequence (product) | geometric (product^(1/|y|))
    rollout_is_veto_threshold: float = 0.0  # > 0: weight 0 for a response with any token ratio below this
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class CriticConfig:
    """The value model of PPO (`algorithm.adv_estimator=gae`): the policy's architecture and initial weights
    with a hidden -> 1 value head, its own optimizer and micro-batch size; the same parallel layout,
    mini-batches, epochs and loss aggregation as the actor."""

    lr: float = 1e-5  # Adam learning rate
    weight_decay: float = 0.0  # AdamW weight decay
    betas: tuple[float, float] = (0.9, 0.999)  # Adam betas
    grad_clip: float = 1.0  # clip the global grad norm to this (0 disables)
    cliprange_value: float = 0.5  # value clipping: new values within old +- this in the clipped loss
    warmup_steps: int = 0  # steps that train only the critic before the policy starts updating
    micro_batch_size: int = 0  # responses per forward/backward pass (0: actor.micro_batch_size)


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"  # grpo | rloo | reinforce_plus_plus(_baseline) | opo | grpo_passk | remax | gpg | gae
    #   or "pkg.mod:fn": a function with the estimators' signature (rl360/algos/advantages.py)
    norm_adv_by_std_in_grpo: bool = True  # divide by the group std (false: Dr.GRPO)
    gamma: float = 1.0  # discount of returns (reinforce_plus_plus, gae)
    lam: float = 1.0  # GAE lambda (gae)
    filter_groups: bool = False  # DAPO dynamic sampling: train only on prompts whose n scores vary
    filter_groups_metric: str = "acc"  # acc: the reward's "acc" extra (else its score), before the overlong
    #                                    penalty | score: the score trained on, overlong penalty included
    max_num_gen_batches: int = 10  # with filter_groups: prompt batches sampled per step at most (0: no limit)
    # with filter_groups, PyVision's partial dynamic filtering: advantages over whole groups, then trajectories
    # filtered one by one (uniform groups, and endings not in partial_filter_keep, dropped); the step trains on
    # data.batch_size * rollout.n trajectories, those of the groups whose scores vary most first
    partial_filter: bool = False
    # the trajectory endings kept: done, max_turns, budget, length, abort, image_token (rl360.core.TRAJECTORY_ENDINGS)
    partial_filter_keep: list[str] = field(default_factory=lambda: ["done", "max_turns"])
    kl_coef: float = 0.0  # weight of the KL(policy || reference) loss; > 0 loads a reference model
    kl_estimator: str = "k3"  # k1 | k2 (mse) | k3 (low_var_kl) | abs; a "+" suffix: straight-through
    kl_in_reward_coef: float = 0.0  # KL(policy || reference) penalty in the reward, per token (0: off)
    kl_in_reward_target: float = 0.0  # > 0: adapt the coefficient towards this KL per sequence
    kl_in_reward_horizon: int = 10000  # adaptive controller horizon, in samples

    @property
    def uses_critic(self) -> bool:
        """Whether the run trains a critic (PPO's gae estimates advantages from its values)."""
        return self.adv_estimator == "gae"


@dataclass
class JudgeConfig:
    """An OpenAI-compatible chat endpoint as LLM judge (rl360.rewards.judge); the key stays in the environment."""

    url: str = ""  # base URL, e.g. http://judge-host:8000/v1 ("": $RL360_JUDGE_URL)
    model: str = ""  # model name the endpoint serves ("": $RL360_JUDGE_MODEL)
    api_key_env: str = "RL360_JUDGE_API_KEY"  # environment variable holding the key (else $OPENAI_API_KEY)
    template: str = "correctness"  # prompt template: correctness | verifier | one from register_template
    max_concurrency: int = 8  # requests in flight at most, per process
    timeout_s: float = 60.0  # limit on one request; a timeout is retried
    max_retries: int = 3  # retries after timeouts, dropped connections, 429 and 5xx (other 4xx: none)
    backoff_s: float = 1.0  # first retry waits about this long, doubling each time (with jitter)
    deadline_s: float = 300.0  # total limit per item from its first request, retries included
    max_tokens: int = 512  # tokens the judge may write per verdict (within its model's context)


@dataclass
class DeepEyesRewardConfig:
    """DeepEyes' reward (rl360.rewards.agentic): accuracy_weight * judge accuracy + format_weight * (-1 on a
    format error) + tool_weight * (a tool was called and the answer is right)."""

    accuracy_weight: float = 0.8  # times the judge's accuracy (1 right, 0 wrong)
    format_weight: float = 0.2  # times the format term (0, or -1 on a format error)
    tool_weight: float = 1.2  # the tool bonus: a tool was called and the answer is right
    max_answer_chars: int = 1000  # an answer this long or longer scores accuracy 0 and is a format error


@dataclass
class RewardConfig:
    num_workers: int = 2  # reward worker processes (0: score in-process, no timeout)
    timeout_s: float = 10.0  # wall-clock limit per reward call; a timeout scores 0 and is counted
    max_memory_gb: float = 16.0  # address-space limit per reward worker (0: none; a reward using CUDA needs 0)
    custom: dict[str, str] = field(default_factory=dict)  # data_source prefix -> "module:function"
    overlong_buffer_len: int = 0  # DAPO overlong penalty: last this many tokens of the budget (0: off)
    overlong_penalty_factor: float = 1.0  # penalty reached at rollout.max_response_length
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    deepeyes: DeepEyesRewardConfig = field(default_factory=DeepEyesRewardConfig)  # DeepEyes' weights
    # refuse to run untrusted code (codegen, CRUXEval) where the sandbox cannot fully isolate it (no uid
    # switch, no namespaces): at start when the data holds such rewards, else the row scores 0 as an error
    require_isolation: bool = True
    # environment variables reward workers get beyond their allow-list (rl360.rewards.pool's docstring)
    env_passthrough: list[str] = field(default_factory=list)


@dataclass
class AgentConfig:
    # "": one response per prompt (no tools); tools: multi-turn, the policy calls `tools` between turns
    loop: str = ""
    # tool-call format: a registered parser (hermes: Qwen's <tool_call>; pyvision: PyVision's <code> blocks, with
    # its <interpreter> replies) or "module:function"
    parser: str = "hermes"
    tools: list[str] = field(default_factory=list)  # built-ins (python, image_zoom_in) or "module:Class"
    max_turns: int = 5  # generated turns per trajectory (rollout.max_response_length bounds all its tokens)
    tool_timeout_s: float = 30.0  # wall clock per tool call; past it the model gets an error reply
    tool_memory_mb: int = 1024  # memory of the code the python tool runs
    max_tool_output_chars: int = 4096  # a tool reply's text is cut past this (and counted as an error)
    max_image_tokens: int = 8192  # image tokens tools may add to one trajectory (zoomed crops, plots)
    min_pixels: int = 3136  # an image a tool returns is resized to at least this area (Qwen-VL's rule)
    max_pixels: int = 1003520  # ... and at most this area
    python: str = ""  # interpreter the python tool runs ("": the sandbox's own; it needs PIL for image_clue_N)
    # end a generated turn where a tool call closes (the parser's closing tag, hermes: </tool_call>, pyvision:
    # </code>, an engine stop string): the calls run without waiting for the end of the turn (one call's block
    # per turn)
    stop_after_call: bool = False
    # the trajectories' turns in step, each round one request (for an engine that decodes a batch at once: hf)
    batch_turns: bool = False
    # generated tokens of one turn at most (0: no limit but rollout.max_response_length); a turn cut there ends
    # the trajectory as one cut by the budget does
    max_turn_tokens: int = 0
    # worker processes starting the python tool's interpreters (0: four per CPU, at most 16; replay mode: one per CPU)
    tool_workers: int = 0
    # fresh sandboxed interpreters the python tool keeps started ahead of trajectories' first calls, refilled in
    # the background (each serves one trajectory only; 0: a trajectory's first call starts its own)
    tool_pool: int = 16
    # every python call in a new sandboxed interpreter that first re-runs the trajectory's earlier cells (the
    # reference the persistent interpreter is measured against; slower, the same replies)
    python_replay: bool = False


@dataclass
class TrackingConfig:
    wandb: bool = False  # also log to Weights & Biases (WANDB_MODE=offline works without network)
    # also log to swanlab, offline: run files under <output_dir>/swanlab (`swanlab sync` uploads one)
    swanlab: bool = False
    tensorboard: bool = False  # also write TensorBoard event files to <output_dir>/tensorboard
    project: str = "rl360"  # wandb / swanlab project
    run_name: str = ""  # wandb / swanlab run name (default: the output_dir's name)
    log_every: int = 1  # print a console line every this many steps


@dataclass
class TrainerConfig:
    total_steps: int = 100  # RL steps to run
    save_hf: bool = True  # write a Hugging Face checkpoint to <output_dir>/hf at the end
    weight_bucket_mb: float = 64.0  # bound on one weight-sync bucket, in MiB
    num_threads: int = 0  # torch threads per worker (0: leave torch's default)
    save_every: int = 0  # write a resumable checkpoint every this many steps, and at the end (0: never)
    keep_checkpoints: int = 2  # newest checkpoints kept under <output_dir>/checkpoints
    resume: bool = True  # continue from <output_dir>/checkpoints/latest when it exists
    # on GPUs: refuse to start a layout whose estimated memory (`rl360 plan`) exceeds the GPU's
    memory_check: bool = True
    # write every this many steps' rollouts (prompt, response, score, engine vs trainer log-prob difference) to
    # <output_dir>/rollouts/step_XXXXXX.jsonl (0: never)
    dump_rollouts_every: int = 0


@dataclass
class ValidationConfig:
    """The held-out prompts of data.val_files during training: when they are evaluated, and how they are sampled
    (verl's val_kwargs); scored as in training. `rl360 eval`'s settings are another config's (rl360/eval/config.py)."""

    # evaluate data.val_files every this many steps, after the step's weight update (0: never); logged as
    # eval/<data_source>/<metric> and eval/all/<metric> in the step's record (rl360 sft: the held-out loss)
    every: int = 0
    before_train: bool = False  # also evaluate before step 1 (logged as step 0; not repeated on resume)
    at_end: bool = False  # also evaluate after the last step when it is no multiple of every
    n: int = 1  # samples per held-out prompt
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # nucleus sampling
    top_k: int = -1  # top-k sampling; -1 disables
    max_response_length: int = 0  # new tokens per sample (0: rollout.max_response_length)
    pass_k: list[int] = field(default_factory=list)  # k of pass@k ([]: 1, 2, 4, ... up to n, and n)


@dataclass
class ClusterConfig:
    ray_address: str = ""  # "" starts a local Ray cluster; "auto" joins a running one
    num_cpus: int = 0  # CPUs for a local cluster (0: all)
    # GPUs for a local cluster (-1: those the machine has; a count on a CPU machine places work as on that many)
    num_gpus: int = -1
    # memory of one GPU in GiB for the start-up memory check (0: read from the trainer's device)
    gpu_memory_gb: float = 0.0
    placement_timeout_s: float = 60.0  # a placement group not ready in this long is refused, naming what is free


@dataclass
class SftConfig:
    """`rl360 sft` (docs/sft.md): conversations from data.train_files (parquet or jsonl), data.batch_size of them per
    optimizer step for trainer.total_steps steps, the held-out loss of data.val_files every validation.every
    steps; the model, optimizer and layout are the actor's (actor.lr, actor.micro_batch_size, actor.parallel.*)."""

    max_length: int = 1024  # conversations longer than this many tokens (prompt included) are skipped and counted
    messages_key: str = "messages"  # multi-turn rows: the column of the {role, content} messages
    tools_key: str = "tools"  # multi-turn rows: the column of the tools offered (JSON-schema specs, or their JSON)
    prompt_key: str = "prompt"  # single-turn rows: the prompt (a string, or a list of messages); verl: question
    response_key: str = "response"  # single-turn rows: the assistant's reply (a string); verl: answer


@dataclass
class DistillConfig:
    """On-policy distillation (docs/distillation.md): a teacher engine scores every token the student sampled, and
    token t's advantage becomes reward_weight * A_t + coef * (log p_teacher(y_t) - log p_student(y_t)). On when a
    teacher is given; teacher and student must share a tokenizer."""

    teacher_url: str = ""  # an engine serving the teacher on SGLang's API (SGLang, `rl360 serve rollout`, a router)
    teacher_model: str = ""  # or a checkpoint directory: rl360 serves it with its HF engine on this machine's CPU
    api_key_env: str = "RL360_TEACHER_API_KEY"  # the environment variable holding teacher_url's key (unset: none)
    # the teacher's tokenizer, to check that it is the student's ("": teacher_model, else the tokenizer_path that
    # teacher_url's /model_info names)
    teacher_tokenizer: str = ""
    coef: float = 1.0  # weight of the per-token reverse-KL term in the advantage
    reward_weight: float = 1.0  # weight of the advantage estimator's (task reward) advantage; 0: distillation alone
    sequences_per_request: int = 32  # samples scored in one /generate request
    max_concurrency: int = 8  # teacher requests in flight at most
    timeout_s: float = 600.0  # limit on one teacher request

    @property
    def enabled(self) -> bool:
        return bool(self.teacher_url or self.teacher_model)


@dataclass
class RunConfig:
    output_dir: str = "outputs/run"  # metrics.jsonl, checkpoints and the final HF model go here
    seed: int = 0  # seeds data order, sampling and initialisation
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    sft: SftConfig = field(default_factory=SftConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)


# Keys whose values come from a closed set: key -> allowed values.
CHOICES: dict[str, tuple[Any, ...]] = {
    "model.dtype": ("float32", "bfloat16"),
    "data.on_bad_row": ("error", "skip"),
    "rollout.mode": ("sync", "async"),
    "rollout.engine_hosts": ("local", "ray"),
    "rollout.router": ("fleet", "sglang"),
    "rollout.router_policy": ("cache_aware", "round_robin", "random", "power_of_two"),
    "actor.loss_agg_mode": AGG_MODES,
    "actor.rollout_correction": ("none", "tis", "mask"),
    "actor.recompute": ("none", "selective", "full"),
    "model.attention": ATTENTION_CHOICES,
    "actor.parallel.cp_comm_type": ("p2p", "all_gather", "a2a"),
    "actor.rollout_is_level": ROLLOUT_IS_LEVELS,
    "algorithm.filter_groups_metric": ("acc", "score"),
    "algorithm.kl_estimator": KL_ESTIMATORS + tuple(f"{name}+" for name in KL_ESTIMATORS),
    "agent.loop": ("", "tools"),
}

# Keys whose values are the names in a registry: key -> the registered names, each with its one-line summary.
REGISTERED: dict[str, Callable[[], dict[str, str]]] = {
    "rollout.engine": engine_summaries,
    "rollout.weight_sync": strategy_summaries,
}


def choices() -> dict[str, tuple[Any, ...]]:
    """Every closed key's allowed values: `CHOICES`, and the names registered for `REGISTERED`'s keys."""
    return {**CHOICES, **{key: tuple(names()) for key, names in REGISTERED.items()}}


# Keys naming a registered function or a "package.module:function" reference: key -> its lookup.
PLUGGABLE = {"actor.loss_mode": get_policy_loss, "algorithm.adv_estimator": get_advantage_estimator}

# Keys whose values must be positive (> 0) or non-negative (>= 0).
POSITIVE = (
    "data.batch_size", "data.max_prompt_length", "rollout.n", "rollout.max_response_length",
    "rollout.num_engines", "rollout.temperature", "actor.ppo_mini_batch_size", "actor.micro_batch_size",
    "actor.ppo_epochs", "actor.parallel.tensor", "actor.parallel.pipeline", "actor.parallel.data",
    "actor.parallel.context", "actor.parallel.virtual_pipeline", "actor.parallel.expert", "trainer.total_steps",
    "trainer.weight_bucket_mb", "reward.timeout_s", "tracking.log_every",
    "actor.rollout_is_threshold", "algorithm.kl_in_reward_horizon", "reward.judge.max_concurrency",
    "trainer.keep_checkpoints", "rollout.request_timeout_s", "rollout.startup_timeout_s",
    "rollout.engine_tensor_parallel", "rollout.mem_fraction", "rollout.max_staleness",
    "reward.judge.timeout_s", "reward.judge.deadline_s", "cluster.placement_timeout_s",
    "agent.max_turns", "agent.tool_timeout_s", "agent.tool_memory_mb", "agent.max_tool_output_chars",
    "agent.min_pixels", "agent.max_pixels", "validation.n", "validation.top_p", "sft.max_length",
    "distill.sequences_per_request", "distill.max_concurrency", "distill.timeout_s",
)
NON_NEGATIVE = (
    "actor.lr", "actor.weight_decay", "actor.grad_clip", "actor.clip_ratio_low", "actor.clip_ratio_high",
    "actor.clip_ratio_c", "actor.entropy_coeff", "actor.rollout_is_threshold_lower",
    "actor.rollout_is_veto_threshold",
    "algorithm.kl_coef", "reward.num_workers", "reward.max_memory_gb", "trainer.num_threads",
    "trainer.dump_rollouts_every",
    "algorithm.max_num_gen_batches", "reward.overlong_buffer_len", "reward.overlong_penalty_factor",
    "algorithm.kl_in_reward_coef", "algorithm.kl_in_reward_target", "critic.lr", "critic.weight_decay",
    "critic.grad_clip", "critic.cliprange_value", "critic.warmup_steps", "critic.micro_batch_size",
    "algorithm.gamma", "algorithm.lam", "distill.coef", "distill.reward_weight",
    "reward.judge.max_retries", "reward.judge.backoff_s", "trainer.save_every", "rollout.max_engine_restarts",
    "actor.max_tokens_per_micro_batch", "actor.moe_aux_loss_coef", "cluster.gpu_memory_gb",
    "agent.max_image_tokens", "agent.tool_workers", "agent.tool_pool", "validation.every",
    "validation.temperature", "validation.max_response_length",
)


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = (), command: str = "train"
                ) -> RunConfig:
    """Read a YAML file (or nothing) and overrides into a `RunConfig` validated for `command` (train, or sft: the
    RL mini-batch keys do not apply to it).

    Overrides apply in order; each is `key=value` (Hydra's `+key=value` and `++key=value` read the same) or
    another YAML file (a preset such as configs/algorithms/gspo.yaml) whose keys replace those before it. A
    single string given for a list key (`data.train_files=a.parquet`) is a one-element list. A YAML syntax
    error is one `file:line:column: problem` line; an unknown key names its close matches, and a verl key the
    rl360 key to use (`VERL_KEYS`)."""
    cfg: RunConfig = load_structured(RunConfig, path, overrides, SCHEMA_KEYS)
    validate(cfg, command)
    return cfg


def load_structured(schema: type, path: str | Path | None, overrides: list[str] | tuple[str, ...] = (),
                    keys: dict[str, str] | None = None) -> Any:
    """A YAML file and overrides merged onto the dataclass `schema` (any typed config: `RunConfig`, the eval
    command's `EvalConfig`), with `load_config`'s rules and errors; `keys` is `schema_keys(schema)`. Returns the
    dataclass, not yet validated."""
    keys = schema_keys(schema) if keys is None else keys
    layers = [OmegaConf.structured(schema)]
    replaced: dict[int, str] = {}  # layer index -> the mapping key it replaces rather than merges into
    verl_reward: dict[str, tuple[Any, str]] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        layers.append(_layer(_checked(lambda: OmegaConf.load(path), f"{path}"), f"{path}", keys, verl_reward))
    for item in overrides:
        if item.endswith((".yaml", ".yml")) and "=" not in item:
            preset = Path(item)
            if not preset.is_file():
                raise ConfigError(f"config file not found: {preset}")
            layers.append(_layer(_checked(lambda preset=preset: OmegaConf.load(preset), f"{preset}"), f"{preset}",
                                 keys, verl_reward))
            continue
        if item.startswith("~"):
            raise ConfigError(f"override {item!r}: Hydra's ~key (delete a key) does not apply to rl360, whose keys "
                              "all have defaults; set the key to the value you want instead")
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        item = item.lstrip("+")  # Hydra's +key=value (add) and ++key=value (add or replace): every key exists here
        where = f"override {item!r}"
        layer = _layer(_checked(lambda item=item: OmegaConf.from_dotlist([item]), where), where, keys, verl_reward)
        key = item.split("=", 1)[0]
        if keys.get(key) == "value" and OmegaConf.is_dict(OmegaConf.select(layer, key)):
            replaced[len(layers)] = key  # as in Hydra, `key={...}` on the command line replaces the mapping
        layers.append(layer)
    if verl_reward:
        layers.append(verl_reward_layer(verl_reward))
    merged = _checked(lambda: _merge(layers, replaced), str(path or "overrides"))
    unset = _unset_environment(OmegaConf.to_container(merged, resolve=False))
    if len(unset) > 1:  # all of them in one line (one alone: the resolver's error below names it)
        reads = ", ".join(f"{key} reads {var}" for key, var in unset)
        raise ConfigError(f"{path or 'overrides'}: environment variables not set: {reads}: export "
                          f"{' '.join(f'{var}=...' for _, var in unset)} or pass "
                          f"{' '.join(f'{key}=...' for key, _ in unset)} on the command line")
    return _checked(lambda: OmegaConf.to_object(merged), str(path or "overrides"))


def _merge(layers: list[Any], replaced: dict[int, str]) -> Any:
    """The layers merged in order (YAML files merge mappings key by key, as Hydra composes them); a layer in
    `replaced` empties its mapping key first."""
    merged = layers[0]
    for index, layer in enumerate(layers[1:], start=1):
        if index in replaced:
            OmegaConf.update(merged, replaced[index], {}, merge=False)
        merged = OmegaConf.merge(merged, layer)
    return merged


_ENV_WITHOUT_DEFAULT = re.compile(r"\$\{oc\.env:([A-Za-z_][A-Za-z0-9_]*)\}")


def _unset_environment(node: Any, key: str = "") -> list[tuple[str, str]]:
    """(key, variable) for each `${oc.env:VAR}` without a default in the unresolved config `node` whose
    variable is not set (a list item's key is its list's)."""
    if isinstance(node, dict):
        return [found for name, value in node.items()
                for found in _unset_environment(value, f"{key}.{name}" if key else str(name))]
    if isinstance(node, list):
        return [found for value in node for found in _unset_environment(value, key)]
    if isinstance(node, str):
        return [(key, var) for var in _ENV_WITHOUT_DEFAULT.findall(node) if var not in os.environ]
    return []


def _checked(build, where: str):
    try:
        return build()
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        context = getattr(err, "context", None)
        problem += f" ({context})" if context else ""
        if where.startswith("override ") or mark is None:  # a key=value: no lines to point at
            raise ConfigError(f"{where}: not valid YAML: {problem}") from None
        raise ConfigError(f"{where}:{mark.line + 1}:{mark.column + 1}: {problem}") from None
    except InterpolationResolutionError as err:
        missing = re.search(r"Environment variable '([^']+)' not found", str(err))
        if missing:
            raise ConfigError(f"{where}: {err.full_key} reads environment variable {missing.group(1)}, which is "
                              f"not set: export {missing.group(1)}=... or pass {err.full_key}=... on the command "
                              "line") from None
        raise ConfigError(f"{where}: {err.full_key}: {str(err).splitlines()[0]}") from None
    except ConfigKeyError as err:
        key = err.full_key or getattr(err, "key", "?")
        raise ConfigError(f"{where}: {unknown_key_message(str(key))}") from None
    except ValidationError as err:
        raise ConfigError(f"{where}: bad value for {err.full_key!r}: {err.msg.splitlines()[0]}") from None
    except OmegaConfBaseException as err:
        raise ConfigError(f"{where}: {str(err).splitlines()[0]}") from None


def schema_keys(node: Any = RunConfig, prefix: str = "") -> dict[str, str]:
    """Every key of the schema, dotted -> "section" (a nested config), "list" (a list value) or "value"."""
    keys: dict[str, str] = {}
    hints = typing.get_type_hints(node)
    for item in dataclasses.fields(node):
        key = f"{prefix}{item.name}"
        if dataclasses.is_dataclass(item.default_factory):
            keys[key] = "section"
            keys.update(schema_keys(item.default_factory, f"{key}."))
        else:
            keys[key] = "list" if typing.get_origin(hints[item.name]) is list else "value"
    return keys


SCHEMA_KEYS = schema_keys()


def _layer(layer: Any, where: str, keys: dict[str, str] = SCHEMA_KEYS, verl_reward: dict | None = None) -> Any:
    """One config layer (a YAML file or an override) checked against the schema before it is merged: a verl key
    with an rl360 key of the same meaning is read as that key (`verl_translation`, said on stderr); any other
    unknown key is a ConfigError naming it (`unknown_key_message`); a string where the schema has a list becomes
    a one-element list. verl's custom_reward_function.{path,name} go into `verl_reward` (all layers' together
    make one reward.custom entry: `verl_reward_layer`)."""
    plain = OmegaConf.to_container(layer, resolve=False)
    moved: list[tuple[str, str, Any]] = []  # (verl key, rl360 key, value)
    verl_reward = {} if verl_reward is None else verl_reward

    def walk(node: dict, prefix: str) -> None:
        for name in list(node):
            key = f"{prefix}{name}"
            kind = keys.get(key)
            if key in VERL_REWARD_KEYS and "reward.custom" in keys:
                verl_reward[name] = (node.pop(name), where)
                continue
            if kind is None:
                if isinstance(node[name], dict) and any(known.startswith(f"{key}.") for known in
                                                        [*VERL_KEYS, *_renamed_in(keys)]):
                    walk(node[name], f"{key}.")  # a verl or renamed section: its keys one by one
                    if not node[name]:
                        del node[name]
                    continue
                target = verl_translation(key, keys)
                if target is None or isinstance(node[name], dict):
                    raise ConfigError(f"{where}: {unknown_key_message(key, node[name], keys)}")
                moved.append((key, target, node.pop(name)))
                continue
            if kind == "section" and isinstance(node[name], dict):
                walk(node[name], f"{key}.")
            elif kind == "list" and isinstance(node[name], str):
                node[name] = [node[name]]

    if isinstance(plain, dict):
        walk(plain, "")
        for verl_key, target, value in moved:
            node = plain
            *sections, leaf = target.split(".")
            for section in sections:
                node = node.setdefault(section, {})
            if leaf in node and node[leaf] != value:
                raise ConfigError(f"{where}: {verl_key} (verl's name for {target}) and {target} are both set, to "
                                  f"{value!r} and {node[leaf]!r}; keep one")
            node[leaf] = [value] if keys.get(target) == "list" and isinstance(value, str) else value
            print(f"rl360: {where}: verl's {verl_key} read as {target}", file=sys.stderr, flush=True)
    return OmegaConf.create(plain)


def _renamed_in(keys: dict[str, str]) -> list[str]:
    """The renamed keys whose new key is one of `keys` (the schema read)."""
    return [old for old, new in RENAMED_KEYS.items() if new in keys]


VERL_REWARD_KEYS = ("custom_reward_function.path", "custom_reward_function.name")
EVERY_SOURCE = "*"  # reward.custom's name for every data_source (rl360.rewards.registry.EVERY)


def verl_reward_layer(given: dict[str, tuple[Any, str]]) -> Any:
    """verl's custom_reward_function (`given`: its path and name, each with where it was set) as a config layer
    setting reward.custom["*"]: the file's function scores every row, called with verl's signature."""
    path, path_where = given.get("path", (None, ""))
    name, name_where = given.get("name", ("compute_score", ""))
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(f"{name_where}: custom_reward_function.name={name!r} needs custom_reward_function.path, "
                          "the Python file that defines it")
    if not isinstance(name, str) or not name.isidentifier():
        raise ConfigError(f"{name_where}: custom_reward_function.name={name!r} is not a Python function name")
    ref = f"{path}:{name}#verl"
    print(f"rl360: {path_where}: verl's custom_reward_function read as reward.custom={{'{EVERY_SOURCE}': "
          f"'{ref}'}}", file=sys.stderr, flush=True)
    return OmegaConf.create({"reward": {"custom": {EVERY_SOURCE: ref}}})


def verl_translation(key: str, keys: dict[str, str] = SCHEMA_KEYS) -> str | None:
    """The rl360 key that verl's `key` names one to one (`VERL_KEYS`), else None (no verl key, or one whose rl360
    counterpart differs in meaning: the table's sentence says how)."""
    target = VERL_KEYS.get(key)
    return target if target is not None and keys.get(target) not in (None, "section") else None


# verl's names (Hydra keys of verl's ppo_trainer / ppo_megatron_trainer configs) -> rl360's key, or a sentence
# where rl360 has no key of the same meaning. A key mapped to an rl360 key is read as it; one mapped to a sentence
# is refused with it.
VERL_KEYS: dict[str, str] = {
    "data.train_batch_size": "data.batch_size",
    "data.max_response_length": "rollout.max_response_length",
    "data.filter_overlong_prompts": "rl360 always skips prompts over data.max_prompt_length, and counts them",
    "data.prompt_key": "rl360 reads the 'prompt' column of the verl schema",
    "actor_rollout_ref.model.path": "model.path",
    "actor_rollout_ref.actor.optim.lr": "actor.lr",
    "actor_rollout_ref.actor.optim.weight_decay": "actor.weight_decay",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "actor.ppo_mini_batch_size",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "actor.micro_batch_size",
    "actor_rollout_ref.actor.ppo_micro_batch_size": "actor.micro_batch_size",
    "actor_rollout_ref.actor.use_dynamic_bsz": "actor.max_tokens_per_micro_batch (> 0 sizes micro-batches by tokens)",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "actor.max_tokens_per_micro_batch",
    "actor_rollout_ref.actor.ppo_epochs": "actor.ppo_epochs",
    "actor_rollout_ref.actor.grad_clip": "actor.grad_clip",
    "actor_rollout_ref.actor.clip_ratio_low": "actor.clip_ratio_low",
    "actor_rollout_ref.actor.clip_ratio_high": "actor.clip_ratio_high",
    "actor_rollout_ref.actor.clip_ratio_c": "actor.clip_ratio_c",
    "actor_rollout_ref.actor.entropy_coeff": "actor.entropy_coeff",
    "actor_rollout_ref.actor.loss_agg_mode": "actor.loss_agg_mode",
    "actor_rollout_ref.actor.policy_loss.loss_mode": "actor.loss_mode",
    "actor_rollout_ref.actor.use_kl_loss": "algorithm.kl_coef (> 0 adds the KL loss)",
    "actor_rollout_ref.actor.kl_loss_coef": "algorithm.kl_coef",
    "actor_rollout_ref.actor.kl_loss_type": "algorithm.kl_estimator",
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": "actor.parallel.tensor",
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size": "actor.parallel.pipeline",
    "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size": "actor.parallel.virtual_pipeline",
    "actor_rollout_ref.actor.megatron.context_parallel_size": "actor.parallel.context",
    "actor_rollout_ref.actor.megatron.expert_model_parallel_size": "actor.parallel.expert",
    "actor_rollout_ref.actor.megatron.sequence_parallel": "actor.parallel.sequence",
    "actor_rollout_ref.actor.megatron.use_distributed_optimizer": "actor.distributed_optimizer",
    "actor_rollout_ref.model.enable_gradient_checkpointing": "actor.recompute",
    "actor_rollout_ref.rollout.n": "rollout.n",
    "actor_rollout_ref.rollout.name": "rollout.engine",
    "actor_rollout_ref.rollout.mode": "rollout.mode",
    "actor_rollout_ref.rollout.temperature": "rollout.temperature",
    "actor_rollout_ref.rollout.top_p": "rollout.top_p",
    "actor_rollout_ref.rollout.top_k": "rollout.top_k",
    "actor_rollout_ref.rollout.response_length": "rollout.max_response_length",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "rollout.engine_tensor_parallel",
    "actor_rollout_ref.rollout.gpu_memory_utilization": "rollout.mem_fraction",
    "algorithm.use_kl_in_reward": "algorithm.kl_in_reward_coef (> 0 adds the KL penalty to the reward)",
    "algorithm.kl_ctrl.kl_coef": "algorithm.kl_in_reward_coef",
    "algorithm.kl_ctrl.target_kl": "algorithm.kl_in_reward_target",
    "algorithm.kl_ctrl.horizon": "algorithm.kl_in_reward_horizon",
    "algorithm.filter_groups.enable": "algorithm.filter_groups",
    "algorithm.filter_groups.metric": "algorithm.filter_groups_metric",
    "algorithm.filter_groups.max_num_gen_batches": "algorithm.max_num_gen_batches",
    "critic.optim.lr": "critic.lr",
    "critic.model.path": "the critic starts from model.path",
    "reward_model.overlong_buffer.len": "reward.overlong_buffer_len",
    "reward_model.overlong_buffer.penalty_factor": "reward.overlong_penalty_factor",
    "custom_reward_function.path": "reward.custom={\"*\": \"PATH:NAME#verl\"}: the file's function scores every row, "
                                   "called with verl's signature",
    "custom_reward_function.name": "the function in custom_reward_function.path (default compute_score)",
    "trainer.total_epochs": "rl360 counts steps, not epochs: set trainer.total_steps; one epoch is the rows "
                            "divided by data.batch_size",
    "trainer.total_training_steps": "trainer.total_steps",
    "trainer.save_freq": "trainer.save_every",
    "trainer.default_local_dir": "output_dir",
    "trainer.project_name": "tracking.project",
    "trainer.experiment_name": "tracking.run_name",
    "trainer.logger": "tracking.wandb (true to log to Weights & Biases too)",
    "trainer.n_gpus_per_node": "cluster.num_gpus",
    "trainer.test_freq": "validation.every",
    "trainer.val_before_train": "validation.before_train",
    "actor_rollout_ref.rollout.val_kwargs.n": "validation.n",
    "actor_rollout_ref.rollout.val_kwargs.temperature": "validation.temperature",
    "actor_rollout_ref.rollout.val_kwargs.top_p": "validation.top_p",
    "actor_rollout_ref.rollout.val_kwargs.top_k": "validation.top_k",
    "actor_rollout_ref.rollout.val_kwargs.do_sample": "validation.temperature (0: greedy)",
}

# rl360 keys renamed: old key -> the key to use; the old one is refused with a message naming the new one
RENAMED_KEYS: dict[str, str] = {
    "trainer.eval_every": "validation.every",
    "trainer.eval_before_train": "validation.before_train",
    "trainer.eval_at_end": "validation.at_end",
    **{f"eval.{name}": f"validation.{name}"
       for name in ("n", "temperature", "top_p", "top_k", "max_response_length", "pass_k")},
}


def unknown_key_message(key: str, value: Any = None, keys: dict[str, str] = SCHEMA_KEYS) -> str:
    """What to say about a key the schema lacks: verl's name for an rl360 key (`VERL_KEYS`), else the closest
    known keys (of `keys`: another schema's, `schema_keys(EvalConfig)`). `value` (the key's value in a YAML layer)
    lets a verl section given whole (`actor_rollout_ref: {...}`) be looked up by its first leaf. A renamed key
    (`RENAMED_KEYS`) is refused naming the key to use."""
    renamed = RENAMED_KEYS.get(key)
    if renamed is not None and renamed in keys:
        return (f"config key {key!r} was renamed to {renamed}: set {renamed} (the training run's held-out "
                "evaluation is the validation section; eval.* configures `rl360 eval`)")
    if isinstance(value, dict) and value and not any(known.startswith(f"{key}.") for known in VERL_KEYS):
        value = None
    while isinstance(value, dict) and value and key not in VERL_KEYS:  # descend to a key the table knows
        name = next(iter(value))
        key, value = f"{key}.{name}", value[name]
    target = VERL_KEYS.get(key)
    if target is not None:
        if target.split()[0] not in keys:  # no rl360 key of that meaning: the sentence says why
            return f"unknown config key {key!r} (verl's): {target}"
        return f"unknown config key {key!r}: that is verl's name; did you mean rl360's {target}?"
    parent, _, leaf = key.rpartition(".")
    candidates = [known for known in keys if keys[known] != "section"]
    if keys.get(parent) == "section":  # a known section: its keys close to the name
        siblings = [known.rpartition(".")[2] for known in candidates if known.rpartition(".")[0] == parent]
        close = [f"{parent}.{name}" for name in difflib.get_close_matches(leaf, siblings, n=3, cutoff=0.6)]
    else:
        close = difflib.get_close_matches(key, candidates, n=3, cutoff=0.6)
    # the same name in another section (data.n -> rollout.n)
    close += [known for known in candidates if known.rpartition(".")[2] == leaf and known not in close]
    if key.startswith("actor_rollout_ref."):
        hint = " (verl's actor_rollout_ref is split into model.*, actor.* and rollout.* in rl360)"
    else:
        hint = ""
    if close:
        return f"unknown config key {key!r}{hint}; close matches: {', '.join(close[:3])}"
    return f"unknown config key {key!r}{hint}; no close match (every key is in rl360/config.py)"


def _get(cfg: RunConfig, key: str) -> Any:
    value: Any = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def context_length(cfg: RunConfig) -> int:
    """The most tokens one sample holds: its prompt (images' tokens included) and its response. An agent's
    response is every turn: generated tokens, tool replies and the images tools add, all within
    rollout.max_response_length (the agent loop ends a trajectory before it would pass it)."""
    return cfg.data.max_prompt_length + cfg.rollout.max_response_length


def validate(cfg: RunConfig, command: str = "train") -> None:
    """Check value ranges and closed choices, and the relations between keys, section by section (those of
    `command`: train, or sft, to which the RL mini-batch keys do not apply)."""
    for check in (_check_values, _check_inputs, _check_algorithm, _check_rollout, _check_agent, _check_lora,
                  _check_distill):
        check(cfg)
    _check_actor(cfg, command)


def _check_values(cfg: RunConfig) -> None:
    """Each key on its own: closed choices, plug-ins that resolve, signs; trackers' packages installed."""
    for key, allowed in choices().items():
        if _get(cfg, key) not in allowed:
            raise ConfigError(f"{key}={_get(cfg, key)!r} is not allowed; choose one of {list(allowed)}")
    for key, lookup in PLUGGABLE.items():
        try:
            lookup(_get(cfg, key))
        except (KeyError, ImportError, AttributeError, TypeError, ValueError) as error:
            raise ConfigError(f"{key}={_get(cfg, key)!r}: {str(error).strip(chr(34))}") from None
    for key in POSITIVE:
        if not _get(cfg, key) > 0:
            raise ConfigError(f"{key}={_get(cfg, key)!r} must be > 0")
    for key in NON_NEGATIVE:
        if _get(cfg, key) is not None and _get(cfg, key) < 0:
            raise ConfigError(f"{key}={_get(cfg, key)!r} must be >= 0")
    for name in ("wandb", "swanlab", "tensorboard"):
        if getattr(cfg.tracking, name) and (missing := missing_package(name)):
            raise ConfigError(missing)


def _check_inputs(cfg: RunConfig) -> None:
    """The model, the data and the held-out evaluation."""
    if not cfg.model.path:
        raise ConfigError("model.path is empty: give a Hugging Face model directory (model.path=DIR); a config "
                          "that sets no model is a preset, to follow a base config: rl360 train BASE.yaml PRESET.yaml")
    if not cfg.data.train_files:
        raise ConfigError("data.train_files is empty: give at least one parquet file, directory or glob")
    evaluates = [f"validation.{key}" for key in ("every", "before_train", "at_end")
                 if getattr(cfg.validation, key)]
    if evaluates and not cfg.data.val_files:
        raise ConfigError(f"{evaluates[0]} evaluates held-out prompts: give them in data.val_files (parquet files, "
                          "directories or globs, rows as in data.train_files)")
    for k in cfg.validation.pass_k:
        if not 1 <= k <= cfg.validation.n:
            raise ConfigError(f"validation.pass_k has {k}: each k must be in [1, validation.n={cfg.validation.n}]")
    if (cfg.model.min_pixels or cfg.model.max_pixels) and not engine_kind(cfg.rollout.engine).pixel_flags:
        raise ConfigError(f"model.min_pixels / model.max_pixels: {engine_kind(cfg.rollout.engine).title} take an "
                          "image's pixel bounds from the model's preprocessor_config.json (min_pixels, max_pixels); "
                          "set them there and leave these at 0")
    if cfg.model.min_pixels < 0 or cfg.model.max_pixels < 0:
        raise ConfigError(f"model.min_pixels={cfg.model.min_pixels}, model.max_pixels={cfg.model.max_pixels}: "
                          "0 (the image processor's own) or a positive area")


def _check_algorithm(cfg: RunConfig) -> None:
    """Advantage estimation and dynamic sampling."""
    algo = cfg.algorithm
    unknown = sorted(set(algo.partial_filter_keep) - set(TRAJECTORY_ENDINGS))
    if unknown:
        raise ConfigError(f"algorithm.partial_filter_keep has {unknown}; a trajectory ends as one of "
                          f"{list(TRAJECTORY_ENDINGS)}")
    if algo.partial_filter and not algo.filter_groups:
        raise ConfigError("algorithm.partial_filter=true filters within dynamic sampling: "
                          "set algorithm.filter_groups=true")
    if algo.partial_filter and (algo.uses_critic or algo.kl_in_reward_coef > 0):
        raise ConfigError("algorithm.partial_filter=true computes group advantages from the scores alone, before any "
                          "log-prob or value: use a group estimator (grpo, rloo, ...) and "
                          "algorithm.kl_in_reward_coef=0")
    for key in ("algorithm.gamma", "algorithm.lam"):
        if _get(cfg, key) > 1.0:
            raise ConfigError(f"{key}={_get(cfg, key)!r} must be in [0, 1]")
    distilling_alone = cfg.distill.enabled and cfg.distill.reward_weight == 0
    if cfg.algorithm.adv_estimator not in ("reinforce_plus_plus", "remax") and not algo.uses_critic and \
            cfg.rollout.n < 2 and not distilling_alone:
        raise ConfigError(f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} needs rollout.n >= 2")


def _check_actor(cfg: RunConfig, command: str = "train") -> None:
    """The policy's batches, parallel layout and loss."""
    if command == "sft" and cfg.data.batch_size % cfg.actor.parallel.data:
        raise ConfigError(f"data.batch_size={cfg.data.batch_size} conversations a step must be a multiple of "
                          f"actor.parallel.data={cfg.actor.parallel.data}")
    if command == "train" and (cfg.actor.ppo_mini_batch_size * cfg.rollout.n) % cfg.actor.parallel.data:
        raise ConfigError(
            f"actor.ppo_mini_batch_size * rollout.n = {cfg.actor.ppo_mini_batch_size * cfg.rollout.n} must be a "
            f"multiple of actor.parallel.data={cfg.actor.parallel.data}"
        )
    parallel = cfg.actor.parallel
    if (parallel.data * parallel.context) % parallel.expert:
        raise ConfigError(f"actor.parallel.expert={parallel.expert} must divide actor.parallel.data x "
                          f"actor.parallel.context = {parallel.data * parallel.context} (megatron takes the "
                          "expert-parallel ranks from the data- and context-parallel ones)")
    if parallel.virtual_pipeline > 1 and parallel.pipeline == 1:
        raise ConfigError(f"actor.parallel.virtual_pipeline={parallel.virtual_pipeline} interleaves layer "
                          "chunks over pipeline stages: it needs actor.parallel.pipeline > 1")
    if cfg.actor.parallel.sequence and cfg.actor.parallel.tensor == 1:
        raise ConfigError("actor.parallel.sequence=true splits tokens over the tensor-parallel ranks: it needs "
                          "actor.parallel.tensor > 1")
    if cfg.actor.parallel.context > 1 and cfg.model.attention == "local":
        raise ConfigError(f"actor.parallel.context={cfg.actor.parallel.context} needs model.attention=auto, te or "
                          "torch (megatron's local attention refuses context parallelism)")
    if command == "train" and cfg.data.batch_size % cfg.actor.ppo_mini_batch_size:
        raise ConfigError(
            f"data.batch_size={cfg.data.batch_size} must be a multiple of "
            f"actor.ppo_mini_batch_size={cfg.actor.ppo_mini_batch_size}"
        )
    if cfg.actor.clip_ratio_c and cfg.actor.clip_ratio_c <= 1.0:
        raise ConfigError(f"actor.clip_ratio_c={cfg.actor.clip_ratio_c} must be > 1 (or 0 to disable dual clip)")
    if cfg.actor.pack_sequences and cfg.model.attention == "local":
        raise ConfigError("actor.pack_sequences=true needs model.attention=auto, te or torch (megatron's local "
                          "attention refuses packed sequences)")
    _check_routing_replay(cfg)


def _check_routing_replay(cfg: RunConfig) -> None:
    """What routing replay does not cover yet: each refused in one line."""
    if not cfg.actor.moe_routing_replay:
        return
    parallel = cfg.actor.parallel
    unsupported = {"actor.parallel.sequence=true": parallel.sequence,
                   f"actor.parallel.context={parallel.context}": parallel.context > 1,
                   "actor.recompute=full": cfg.actor.recompute == "full",
                   f"agent.loop={cfg.agent.loop!r}": bool(cfg.agent.loop),
                   "rollout.partial=true": cfg.rollout.partial}
    for setting, present in unsupported.items():
        if present:
            raise ConfigError(f"actor.moe_routing_replay=true does not work with {setting} yet (see "
                              "docs/moe-routing-replay.md)")


def _check_rollout(cfg: RunConfig) -> None:
    """The engines, their placement and weight sync, and what bounds a response."""
    if "" in cfg.rollout.stop:
        raise ConfigError(f"rollout.stop={list(cfg.rollout.stop)!r} has an empty string, which every text holds: "
                          "list non-empty stop strings")
    if cfg.reward.overlong_buffer_len >= cfg.rollout.max_response_length:
        raise ConfigError(f"reward.overlong_buffer_len={cfg.reward.overlong_buffer_len} must be < "
                          f"rollout.max_response_length={cfg.rollout.max_response_length}")
    _check_engines(cfg.rollout)
    if cfg.rollout.mem_fraction > 1:
        raise ConfigError(f"rollout.mem_fraction={cfg.rollout.mem_fraction} must be in (0, 1]")


def _check_engines(rollout: RolloutConfig) -> None:
    """The engines' kind against what is asked of them (`rl360.core.engine_kinds`), and the weight sync against
    the engines it reaches (`rl360.weight_sync.registry`)."""
    kind, sync = engine_kind(rollout.engine), get_strategy(rollout.weight_sync)
    processes = f"rollout.engine={either(engine_names('processes'))}"
    if kind.in_process and rollout.num_engines != 1:
        raise ConfigError(f"rollout.num_engines={rollout.num_engines} needs {processes} (rollout.engine="
                          f"{kind.name} is one in-process engine)")
    if rollout.colocate and kind.processes and rollout.mode != "sync":
        raise ConfigError(f"rollout.colocate=true with rollout.engine={kind.name} needs rollout.mode=sync "
                          f"(got mode={rollout.mode}): colocated engines release the GPU while the trainer trains")
    if kind.processes and not sync.reaches(kind.name):
        raise ConfigError(f"rollout.weight_sync={sync.name} {sync.engines_note or 'does not reach these engines'}; "
                          f"with rollout.engine={kind.name} use rollout.weight_sync="
                          f"{either(usable_strategies(kind.name))}")
    if rollout.router == "sglang" and kind.in_process:
        raise ConfigError(f"rollout.router=sglang puts sglang-router in front of engine processes: it needs "
                          f"{processes} (rollout.engine={kind.name} has no HTTP server)")
    if rollout.engine_hosts == "ray" and (kind.in_process or rollout.colocate or sync.same_host):
        same_host = [name for name, info in strategies().items() if info.same_host]
        other_hosts = [name for name, info in strategies().items() if not info.same_host]
        raise ConfigError(f"rollout.engine_hosts=ray needs {processes}, rollout.colocate=false and "
                          f"rollout.weight_sync={either(other_hosts)} ({either(same_host)} sync and colocation "
                          f"need the engines on the trainer's node; got engine={kind.name}, colocate="
                          f"{rollout.colocate}, weight_sync={sync.name})")
    if rollout.partial and (kind.in_process or rollout.mode != "async"):
        raise ConfigError(f"rollout.partial=true needs {processes} and rollout.mode=async (got engine={kind.name}, "
                          f"mode={rollout.mode}): only then can a weight update meet requests in flight")


def _check_agent(cfg: RunConfig) -> None:
    """The multi-turn agent loop and its tools."""
    if cfg.agent.loop and not cfg.agent.tools:
        raise ConfigError(f"agent.loop={cfg.agent.loop!r} needs agent.tools: name at least one (python, image_zoom_in "
                          "or 'module:Class')")
    for index, name in enumerate(cfg.agent.tools):
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f"agent.tools[{index}]={name!r}: a tool name or 'module:Class'")
    if not cfg.agent.parser:
        raise ConfigError("agent.parser is empty: hermes, pyvision or 'module:function'")
    if cfg.agent.min_pixels > cfg.agent.max_pixels:
        raise ConfigError(f"agent.min_pixels={cfg.agent.min_pixels} must be <= agent.max_pixels={cfg.agent.max_pixels}")


def _check_distill(cfg: RunConfig) -> None:
    """On-policy distillation's teacher."""
    distill = cfg.distill
    if distill.teacher_url and distill.teacher_model:
        raise ConfigError(f"distill.teacher_url={distill.teacher_url!r} and distill.teacher_model="
                          f"{distill.teacher_model!r}: give one teacher (a served one, or a checkpoint rl360 serves)")
    if distill.enabled and distill.coef == 0 and distill.reward_weight == 0:
        raise ConfigError("distill.coef=0 and distill.reward_weight=0 leave no advantage: set one > 0")


def _check_lora(cfg: RunConfig) -> None:
    lora = cfg.actor.lora
    if lora.rank < 0:
        raise ConfigError(f"actor.lora.rank={lora.rank} must be >= 0 (0: no adapters, the whole model trains)")
    if not lora.rank:
        return
    if lora.alpha <= 0 or not 0 <= lora.dropout < 1:
        raise ConfigError(f"actor.lora.alpha={lora.alpha} must be > 0 and actor.lora.dropout={lora.dropout} in [0, 1)")
    try:
        if not expand_targets(list(lora.targets)):
            raise ValueError("no targets")
    except ValueError as error:
        raise ConfigError(f"actor.lora.targets={list(lora.targets)}: {error}") from None
    if cfg.model.attention == "te":
        raise ConfigError("actor.lora.rank > 0 adapts the torch and local layer specs' linears: use "
                          "model.attention=auto or torch (not te)")


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    """The config as plain nested dicts (for logging and wandb)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]
