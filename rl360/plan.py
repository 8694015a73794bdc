"""`rl360 plan CONFIG`: the memory one GPU of a run's layout needs, term by term, and whether it fits.

    rl360 plan configs/my_run.yaml [key=value ...] [--gpu-memory-gb 80] [--gpus-per-node 8]

Counted for the fullest policy rank (the pipeline stage holding the most; tensor-parallel slices as megatron
makes them, the vocabulary padded as the bridge pads it; a mixture of experts' routed experts 1/EP on each rank)
from the model's `config.json` alone (without a local checkpoint, the shape of the released model that
`model.path` names, e.g. `Qwen/Qwen2.5-7B-Instruct`: `rl360.model_shapes`). A Qwen-VL model's vision tower is
counted whole on the first stage (it is replicated there); its activations are not (a few thousand image tokens
against the language model's tens of thousands of sequence tokens).

- LoRA (`actor.lora.rank` > 0): the adapters add to the weights, and only they have gradients and optimizer
  state (`lora_rank_parameters`).
- weights: parameters x `model.dtype` bytes; gradients: megatron's fp32 gradient buffer (4 bytes a parameter);
  optimizer: Adam's two fp32 moments, plus the fp32 main copy of bf16 weights (megatron's mixed precision),
  split over the data-parallel ranks with `actor.distributed_optimizer` (routed experts' over the
  data x context / EP expert-data-parallel ranks); the reference model (weights only)
  when a KL term needs it; the critic (its own weights, gradients and optimizer) for PPO. Each term is counted in
  the phases it is on the GPU in: the forward and backward passes (train), the optimizer step that ends each
  mini-batch (step) and the rollouts (rollout). With `actor.offload` the gradients and reference are there only
  while training, the optimizer only for its steps (and the weights only while training, with colocated
  engines); the activations are there only in the passes.
- activations of the micro-batches in flight (1F1B keeps up to PP of them on the first stage; with
  `actor.parallel.virtual_pipeline` = V the interleaved schedule keeps up to (V + 1) x PP - 1 chunk passes of
  1/V of the stage's layers each, about 1 + (PP - 1) / (PP x V) times as much): per layer and
  token, (10 + 24 / TP) x hidden bytes at 2-byte activations, 34 / TP x hidden with sequence parallelism
  (Korthikanti et al., 2022), doubled at fp32, plus the attention score matrix with `model.attention=local`
  (5 x heads x sequence bytes per token / TP); `actor.recompute=selective` keeps no scores, `full` keeps each
  layer's input (2 x hidden bytes, / TP with sequence parallelism) and one layer's working set; the last stage
  adds the vocabulary logits (its slice) in the dtype and in fp32.
  A mixture of experts' layers are counted as dense ones of the same hidden size (the routed tokens' copies,
  top-k x hidden a token, and the experts' intermediates are not added).
  Tokens per micro-batch: `actor.max_tokens_per_micro_batch`, else micro_batch_size x (prompt + response),
  divided over `actor.parallel.context` ranks.
- rollout engines: `rollout.colocate` puts them on the trainer's GPUs (as `rl360.cluster.placement` decides for
  `--gpus`): an hf engine holds the whole model beside policy rank 0; others take `rollout.mem_fraction` of each
  while they generate (training keeps its weights, gradients and optimizer meanwhile); otherwise they have
  GPUs of their own, holding the weights (in `model.dtype`, split over `rollout.engine_tensor_parallel`) and
  a KV cache in the rest of `mem_fraction`, reported as the tokens it holds against one step's rollouts.

It is an estimate from shapes (allocator fragmentation, CUDA context and NCCL buffers take a few GB more: 2 GiB
is reserved for them). `tests/test_plan.py` checks the weights, gradients and optimizer terms against the
tensors megatron allocates for small models on CPU.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_bridge.arch import get_architecture
from megatron_bridge.config_map import head_dim, num_experts, num_query_groups, padded_vocab_size
from megatron_bridge.lora import expand_targets
from megatron_bridge.vision import is_vision_language, language_config, vision_parameter_count
from rl360.actor.batch import interleaved_micro_batches, interleaving_group
from rl360.cluster.placement import Placement
from rl360.config import context_length
from rl360.core.engine_kinds import engine_kind
from rl360.model_shapes import RELEASED, close_names, released_config, released_name

GIB = 1024 ** 3
RESERVED_GIB = 2.0  # CUDA context, NCCL buffers, fragmentation
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


# when a term is on the GPU: the forward and backward passes of an update (and log-prob passes), the optimizer
# step that ends each mini-batch, and the rollouts (colocated engines generating)
PHASES = ("train", "step", "rollout")
PHASE_NAMES = {"train": "training (forward and backward)", "step": "the optimizer step",
               "rollout": "generating"}


@dataclass
class Term:
    name: str
    bytes: float
    phases: tuple[str, ...] = PHASES  # the phases it is on the GPU in

    @property
    def phase(self) -> str:
        return "all" if set(self.phases) == set(PHASES) else "+".join(self.phases)


@dataclass
class Plan:
    terms: list[Term]
    gpu_memory_gb: float
    engine_lines: list[str]  # what the engines' own GPUs hold (disaggregated engines)

    def total(self, phase: str) -> float:
        return sum(term.bytes for term in self.terms if phase in term.phases) + RESERVED_GIB * GIB

    def largest(self, phase: str) -> Term:
        return max((term for term in self.terms if phase in term.phases), key=lambda term: term.bytes)

    def fits(self) -> bool:
        return all(self.total(phase) <= self.gpu_memory_gb * GIB for phase in PHASES)

    def problem(self) -> str | None:
        """None when it fits; else which phase does not, by how much, and its largest term."""
        for phase in PHASES:
            total = self.total(phase)
            if total > self.gpu_memory_gb * GIB:
                big = self.largest(phase)
                return (f"the {phase} phase needs {total / GIB:.1f} GiB a GPU, more than {self.gpu_memory_gb:g} "
                        f"GiB; the largest term is {big.name} ({big.bytes / GIB:.1f} GiB)")
        return None

    def report(self) -> str:
        lines = [f"{'term':44} {'GiB':>8}  phase"]
        lines += [f"{term.name:44} {term.bytes / GIB:8.2f}  {term.phase}" for term in self.terms]
        lines.append(f"{'reserved (CUDA context, NCCL, fragmentation)':44} {RESERVED_GIB:8.2f}  all")
        for phase in PHASES:
            lines.append(f"{'total during ' + PHASE_NAMES[phase]:44} {self.total(phase) / GIB:8.2f}  of "
                         f"{self.gpu_memory_gb:g}")
        lines += self.engine_lines
        problem = self.problem()
        lines.append("fits" if problem is None else f"does not fit: {problem}")
        return "\n".join(lines)


def rank_parameters(hf: dict[str, Any], tensor: int = 1, pipeline: int = 1, stage: int = 0,
                    vocab_divisible_by: int = 128, expert: int = 1) -> int:
    """Parameters one tensor-parallel rank of pipeline `stage` (and, for a mixture of experts, expert-parallel
    rank of `expert`) holds in the bridge's megatron model."""
    return sum(rank_parameter_split(hf, tensor, pipeline, stage, vocab_divisible_by, expert))


def rank_parameter_split(hf: dict[str, Any], tensor: int = 1, pipeline: int = 1, stage: int = 0,
                         vocab_divisible_by: int = 128, expert: int = 1) -> tuple[int, int]:
    """(parameters outside the routed experts, routed experts' parameters) of one rank, as `rank_parameters`
    counts them: the routed experts are split over EP (each rank 1/`expert` of them) and expert TP (megatron's
    default: TP); the router, and Qwen2-MoE's shared expert and its gate, are dense parts of the layer."""
    arch = get_architecture(hf)
    vision_tower = vision_parameter_count(hf) if arch.vision and stage == 0 else 0  # replicated on the first stage
    hf = language_config(hf) if arch.vision else hf
    hidden, layers = hf["hidden_size"], hf["num_hidden_layers"]
    heads, groups, width = hf["num_attention_heads"], num_query_groups(hf), head_dim(hf)
    qkv_rows = (heads + 2 * groups) * width // tensor
    per_layer = (qkv_rows * hidden + (qkv_rows if arch.qkv_bias else 0)  # linear_qkv
                 + hidden * heads * width // tensor  # linear_proj
                 + 2 * hidden  # input and pre-MLP norms
                 + (2 * width if arch.qk_layernorm else 0))
    experts = num_experts(hf) if arch.moe else 0
    per_layer_experts = 0
    if experts:
        shared = int(hf.get("shared_expert_intermediate_size") or 0)
        per_layer += experts * hidden  # router
        per_layer += 3 * shared // tensor * hidden + (hidden if shared else 0)  # shared expert and its gate
        per_layer_experts = experts // expert * 3 * (hf["moe_intermediate_size"] // tensor) * hidden
    else:
        ffn = hf["intermediate_size"]
        per_layer += 2 * ffn // tensor * hidden + hidden * ffn // tensor  # gate/up and down
    count = per_layer * layers // pipeline
    embedding = padded_vocab_size(hf["vocab_size"], tensor, vocab_divisible_by) // tensor * hidden
    first, last = stage == 0, stage == pipeline - 1
    if first:
        count += embedding
    if last:
        count += hidden  # final norm
        if not hf.get("tie_word_embeddings") or not first:  # an output layer of its own (tied: a copy at PP > 1)
            count += embedding
    return count + vision_tower, per_layer_experts * layers // pipeline


def lora_rank_parameters(hf: dict[str, Any], rank: int, targets: tuple[str, ...], tensor: int = 1,
                         pipeline: int = 1) -> int:
    """LoRA adapter parameters one tensor-parallel rank of the fullest pipeline stage holds (`megatron_bridge.lora`:
    a column-parallel projection's A [rank, in] whole and B [out / TP, rank]; a row-parallel one's A [rank, in / TP]
    and B [out, rank] whole)."""
    hf = language_config(hf) if get_architecture(hf).vision else hf
    hidden, heads, groups, width = hf["hidden_size"], hf["num_attention_heads"], num_query_groups(hf), head_dim(hf)
    ffn = hf.get("intermediate_size", 0)
    column = {"q_proj": (hidden, heads * width), "k_proj": (hidden, groups * width),
              "v_proj": (hidden, groups * width), "gate_proj": (hidden, ffn), "up_proj": (hidden, ffn)}
    row = {"o_proj": (heads * width, hidden), "down_proj": (ffn, hidden)}
    per_layer = sum(rank * (fan_in + fan_out // tensor) for name, (fan_in, fan_out) in column.items()
                    if name in targets)
    per_layer += sum(rank * (fan_in // tensor + fan_out) for name, (fan_in, fan_out) in row.items()
                     if name in targets)
    return per_layer * -(-hf["num_hidden_layers"] // pipeline)


def plan(cfg: Any, gpu_memory_gb: float = 80.0, placement: Placement | None = None) -> Plan:
    """The per-GPU memory of a policy rank (and of an engine of its own) under `cfg`, colocated or not and with a
    critic or not as `placement` decided (without one: as `rollout.colocate` and `algorithm.adv_estimator` ask)."""
    hf = hf_file = model_config(cfg.model.path)
    parallel, actor, rollout = cfg.actor.parallel, cfg.actor, cfg.rollout
    colocate = placement.colocate if placement is not None else bool(rollout.colocate)
    tp, pp, ep = parallel.tensor, parallel.pipeline, parallel.expert
    dtype = DTYPE_BYTES[cfg.model.dtype]
    dense, experts = max((rank_parameter_split(hf, tp, pp, stage, expert=ep) for stage in range(pp)), key=sum)
    params = dense + experts
    lora = 0  # LoRA: only the adapters have gradients and optimizer state (the base weights are frozen)
    if actor.lora.rank:
        lora = lora_rank_parameters(hf, actor.lora.rank, expand_targets(list(actor.lora.targets)), tp, pp)
    hf = language_config(hf) if is_vision_language(hf) else hf  # the language model's fields from here on
    optimizer_bytes = 8 + (4 if dtype == 2 else 0)
    shards = parallel.data if actor.distributed_optimizer else 1
    # the distributed optimizer splits the routed experts' state over their expert-data-parallel ranks
    expert_shards = max(1, parallel.data * parallel.context // ep) if actor.distributed_optimizer else 1
    optimizer_params = dense / shards + experts / expert_shards
    trained = params
    if lora:
        trained, optimizer_params = lora, lora / shards
    # offload: gradients and the reference model are on the GPU only while training (an update, reference
    # log-probs), the optimizer only for its steps; the weights leave too between calls when colocated engines
    # take the memory
    updating = ("train", "step") if actor.offload else PHASES
    sharded = f", 1/{shards}" if shards > 1 else ""  # the distributed optimizer's share
    adapters = f" + LoRA rank {actor.lora.rank}" if lora else ""
    terms = [Term(f"policy weights{adapters}", (params + lora) * dtype, updating if colocate else PHASES),
             Term(f"policy gradients (fp32 buffer{', adapters' if lora else ''})", trained * 4, updating),
             Term(f"policy optimizer (Adam{' + fp32 main weights' if dtype == 2 else ''}{sharded})",
                  optimizer_params * optimizer_bytes, ("step",) if actor.offload else PHASES)]
    if cfg.algorithm.kl_coef > 0 or cfg.algorithm.kl_in_reward_coef > 0:
        terms.append(Term("reference model weights", params * dtype, ("train",) if actor.offload else PHASES))
    if placement.critic_ranks if placement is not None else cfg.algorithm.uses_critic:
        terms.append(Term("critic weights, gradients, optimizer",
                          params * (dtype + 4) + optimizer_params * optimizer_bytes, updating))
    terms.append(Term(f"activations (recompute={actor.recompute})", activation_bytes(cfg, hf), ("train",)))
    engine_lines = []
    kind = engine_kind(rollout.engine)
    if colocate and kind.in_process:  # the whole model, beside policy rank 0, all the time
        terms.append(Term(f"colocated {kind.name} engine weights", rank_parameters(hf_file, 1, 1, 0) * dtype))
    elif colocate:
        terms.append(Term(f"colocated engine (mem_fraction {rollout.mem_fraction:g})",
                          rollout.mem_fraction * gpu_memory_gb * GIB, ("rollout",)))
    elif kind.static_memory:
        engine_lines = engine_report(cfg, hf, gpu_memory_gb)
    return Plan(terms, gpu_memory_gb, engine_lines)


def model_config(path: str) -> dict[str, Any]:
    """The config.json of the model directory `path`, else the released shape `path` names (a hub id such as
    "Qwen/Qwen2.5-7B-Instruct": `rl360.model_shapes`); `ConfigError` saying what to give otherwise."""
    from rl360.config import ConfigError

    config_file = Path(path) / "config.json"
    if config_file.is_file():
        return json.loads(config_file.read_text())
    known = released_config(path)
    if known is not None:
        return known
    where = "no config.json there" if Path(path).is_dir() else "no such directory"
    build = " (rl360 quickstart builds it)" if "quickstart_assets" in str(path) else ""
    close = close_names(path)
    if close and not Path(path).is_dir():
        raise ConfigError(f"model.path={path}: {where}, and not a released model's name rl360 knows; did you mean "
                          f"{' or '.join(close)}?")
    raise ConfigError(f"model.path={path}: {where} to plan from{build}; give a model directory with config.json or "
                      f"a released model's name ({', '.join(RELEASED)})")


def activation_bytes(cfg: Any, hf: dict[str, Any]) -> float:
    """Activations kept for the backward pass on the fullest rank (see the module docstring)."""
    actor, parallel = cfg.actor, cfg.actor.parallel
    tp, pp = parallel.tensor, parallel.pipeline
    sequence = context_length(cfg)
    tokens = actor.max_tokens_per_micro_batch or actor.micro_batch_size * sequence
    responses = cfg.actor.ppo_mini_batch_size * cfg.rollout.n // parallel.data
    micro_batches = max(1, -(-responses * sequence // tokens))
    chunks = parallel.virtual_pipeline
    if chunks > 1:  # interleaved: the first stage's warm-up passes (2 (PP - 1) + (V - 1) x group) and one more,
        micro_batches = interleaved_micro_batches(micro_batches, pp, chunks)  # each over 1/V of the stage's layers
        in_flight = min(micro_batches * chunks, 2 * (pp - 1) + (chunks - 1) * interleaving_group(micro_batches, pp) + 1)
    else:
        in_flight = min(pp, micro_batches)
    tokens = tokens / parallel.context  # context parallelism: each rank holds 1/cp of every sequence
    hidden, layers = hf["hidden_size"], hf["num_hidden_layers"] // (pp * chunks)  # one chunk's layers
    scale = DTYPE_BYTES[cfg.model.dtype] / 2
    sequence = parallel.sequence
    # one layer's activations per micro-batch: with sequence parallelism all 34 bytes a token split over TP,
    # without it the norms', residuals' and dropouts' 10 bytes kept whole on every rank
    working = (34 / tp if sequence else 10 + 24 / tp) * tokens * hidden * scale
    scores = 5 * hf["num_attention_heads"] * min(sequence, tokens) * tokens / tp if cfg.model.attention == "local" \
        else 0.0
    if actor.recompute == "full":
        per_micro = layers * 2 * tokens * hidden * scale / (tp if sequence else 1) + working + scores
    else:
        per_micro = layers * (working + (scores if actor.recompute == "none" else 0.0))
    vocab = padded_vocab_size(hf["vocab_size"], tp) / tp
    logits = tokens * vocab * (DTYPE_BYTES[cfg.model.dtype] + 4)
    return in_flight * per_micro + logits


def engine_report(cfg: Any, hf: dict[str, Any], gpu_memory_gb: float) -> list[str]:
    """What one disaggregated engine's GPUs hold: weights, and the KV cache room against a step's tokens."""
    rollout = cfg.rollout
    engine_tp = rollout.engine_tensor_parallel
    dtype = DTYPE_BYTES[cfg.model.dtype]
    weights = rank_parameters(hf, engine_tp, 1, 0) * dtype
    room = rollout.mem_fraction * gpu_memory_gb * GIB - weights
    kv_per_token = 2 * hf["num_hidden_layers"] * max(1, num_query_groups(hf) // engine_tp) * head_dim(hf) * dtype
    step_tokens = cfg.data.batch_size * rollout.n * context_length(cfg)
    held = max(room, 0) / kv_per_token * rollout.num_engines
    lines = [f"each engine GPU (tp {engine_tp}): weights {weights / GIB:.2f} GiB, KV cache "
             f"{max(room, 0) / GIB:.2f} GiB = {held / rollout.num_engines:,.0f} tokens"]
    lines.append(f"{rollout.num_engines} engine(s) hold {held:,.0f} tokens; one step's rollouts are at most "
                 f"{step_tokens:,} ({min(held / step_tokens, 1.0):.0%} of them at once)")
    if room <= 0:
        lines.append(f"the engines do not fit: their weights take more than mem_fraction {rollout.mem_fraction:g} "
                     f"of {gpu_memory_gb:g} GiB")
    return lines


def add_plan_parser(commands) -> None:
    parser = commands.add_parser("plan", help="per-GPU memory of a config's layout, and whether it fits")
    parser.add_argument("config", help="YAML config")
    parser.add_argument("overrides", nargs="*", help="key=value overrides")
    parser.add_argument("--gpu-memory-gb", type=float, default=80.0, help="memory of one GPU (H100: 80)")
    parser.add_argument("--gpus-per-node", type=int, default=8,
                        help="GPUs a node has (to say how many nodes the layout takes)")
    parser.add_argument("--gpus", type=int, default=0,
                        help="GPUs the cluster has (0: as many as the layout asks for); fewer colocates the engines "
                             "where rollout.colocate is unset, or refuses the layout")
    parser.set_defaults(run=_run)


def _is_eval_config(path: str) -> bool:
    """Whether the YAML file at `path` is an `rl360 eval` config: top-level `eval` and `sampling` sections."""
    import yaml

    try:
        top = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return False  # load_config says what is wrong with the file
    return isinstance(top, dict) and "eval" in top and "sampling" in top


def _run(args: argparse.Namespace) -> int:
    from rl360.cluster.placement import gpus_asked, make_placement
    from rl360.config import ConfigError, load_config

    if _is_eval_config(args.config):
        raise ConfigError(f"{args.config} is an `rl360 eval` config (it has eval: and sampling: sections); rl360 plan "
                          "plans training runs: give it a training config, e.g. configs/quickstart.yaml")
    cfg = load_config(args.config, args.overrides)
    parallel = cfg.actor.parallel
    ranks = parallel.ranks
    critic = cfg.algorithm.uses_critic
    gpus = args.gpus or gpus_asked(ranks, critic, cfg.rollout)
    placement = make_placement(ranks, critic, cfg.rollout, gpus)
    context = f" x CP {parallel.context}" if parallel.context > 1 else ""
    experts = f" (EP {parallel.expert} within them)" if parallel.expert > 1 else ""
    nodes = -(-ranks // args.gpus_per_node)
    print(f"{cfg.model.path}: policy TP {parallel.tensor}{context} x PP {parallel.pipeline} x DP {parallel.data}"
          f"{experts} = {ranks} GPU(s) ({nodes} node(s) of {args.gpus_per_node}), dtype {cfg.model.dtype}")
    print(placement.describe())
    if not (Path(cfg.model.path) / "config.json").is_file() and released_name(cfg.model.path):
        print(f"no local checkpoint at {cfg.model.path}: planned with the released {released_name(cfg.model.path)}'s "
              "shape")
    turns = (f"; an agent's response holds up to {cfg.agent.max_turns} turns, tool replies and tool images "
             f"({', '.join(cfg.agent.tools) or 'no tools'})") if cfg.agent.loop else ""
    print(f"context per sample: {context_length(cfg):,} tokens (prompt {cfg.data.max_prompt_length:,} + response "
          f"{cfg.rollout.max_response_length:,}{turns})")
    if cfg.actor.lora.rank:
        hf = model_config(cfg.model.path)
        adapters = lora_rank_parameters(hf, cfg.actor.lora.rank, expand_targets(list(cfg.actor.lora.targets)),
                                        parallel.tensor, parallel.pipeline)
        whole = max(rank_parameters(hf, parallel.tensor, parallel.pipeline, stage)
                    for stage in range(parallel.pipeline))
        print(f"LoRA rank {cfg.actor.lora.rank}: {adapters:,} trainable parameters a rank against {whole:,} frozen "
              f"({adapters / whole:.2%})")
    result = plan(cfg, args.gpu_memory_gb, placement)
    print(result.report())
    return 0 if result.fits() else 1
