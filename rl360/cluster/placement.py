"""Who runs on which GPU: one placement plan for a run, made from its settings and the GPUs the cluster has
before any worker starts, read by the trainer, the engine fleet, the policy's ranks and `rl360 plan`. What it
decides (colocation, the weight sync that needs) is this value, passed on; the config keeps what was asked.

    placement = make_placement(cfg.actor.parallel.ranks, cfg.algorithm.uses_critic, cfg.rollout,
                               gpus=ray_gpus)        # PlacementError naming what does not fit
    print(placement.describe())
    placement.engine_devices(0, visible)          # engine 0's GPUs on the trainer's node (engine_hosts=local)

On GPUs the trainer (policy ranks, plus as many critic ranks for PPO) takes one GPU a rank; the engines take
`rollout.engine_tensor_parallel` GPUs each beside them, or none of their own when colocated:

- `rollout.colocate` unset (the default) colocates exactly when the cluster has too few GPUs for separate
  engines and colocation can run there (a one-GPU machine runs the default config colocated); true or false
  is obeyed, and refused when it cannot run.
- colocated `hf`: the in-process engine shares policy rank 0's GPU (Ray gives each of the two half of that
  bundle); colocated `server` / `sglang`: engine i takes the i-th run of `engine_tensor_parallel` of the
  trainer's GPUs, releasing its memory while the trainer trains (sync mode only).
- `rollout.weight_sync=distributed` puts the trainer's export rank and every engine in one NCCL group, which
  NCCL refuses when two of them are on one GPU: colocated `server` engines on GPUs take `tensor` (CUDA IPC on
  the same device) instead, with a note; colocated `sglang` engines need `disk` (SGLang reads neither of rl360's
  tensor formats), and are refused without it. Each strategy's facts (the engines it reaches, whether it shares
  a GPU, whether it may stand in) are its registration (`rl360.weight_sync.registry`), each engine kind's
  `rl360.core.engine_kinds`.

A layout that cannot fit is refused with one message naming the counts and what to change; the notes say
what was decided in the user's place. On CPU (no GPUs) every component takes CPU slots and nothing is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rl360.config import ConfigError
from rl360.core.engine_kinds import either, engine_kind
from rl360.weight_sync.registry import get_strategy, strategies, usable_strategies


class PlacementError(ConfigError):
    """A layout that cannot run on this cluster; the message names the counts and what to change."""


@dataclass(frozen=True)
class Placement:
    gpus: int  # GPUs the cluster has (0: a CPU run)
    policy_ranks: int
    critic_ranks: int  # PPO's critic: as many ranks as the policy, on GPUs of their own (0 without a critic)
    engine: str  # hf | server | sglang
    num_engines: int
    engine_width: int  # GPUs of one engine (rollout.engine_tensor_parallel)
    engine_hosts: str  # local | ray
    colocate: bool
    weight_sync: str
    notes: tuple[str, ...] = ()  # what was decided in the user's place, and why

    @property
    def use_gpu(self) -> bool:
        return self.gpus > 0

    @property
    def trainer_gpus(self) -> int:
        return self.policy_ranks + self.critic_ranks

    @property
    def engine_gpus(self) -> int:
        """GPUs the engines take beside the trainer's (0 when colocated)."""
        return 0 if self.colocate else self.num_engines * self.engine_width

    @property
    def gpus_needed(self) -> int:
        return self.trainer_gpus + self.engine_gpus

    @property
    def gpu_share(self) -> float:
        """The fraction of its bundle's GPU (and CPUs) each actor on a shared bundle takes: a colocated hf engine
        and policy rank 0 take half each (Ray then gives both the same device)."""
        return 0.5 if self.use_gpu and self.colocate and engine_kind(self.engine).in_process else 1.0

    def engine_devices(self, index: int, visible: list[str]) -> list[str]:
        """Engine `index`'s devices among the trainer node's `visible` ones (CUDA_VISIBLE_DEVICES, or 0..n-1):
        the index-th run of `engine_width` of them, from the first (colocated: under the policy's ranks) or
        after the trainer's."""
        first = (0 if self.colocate else self.trainer_gpus) + index * self.engine_width
        if first + self.engine_width > len(visible):
            raise PlacementError(f"rollout engine {index} needs GPUs {first}-{first + self.engine_width - 1} of the "
                                 f"trainer's node, which has {len(visible)}: lower rollout.num_engines x "
                                 "rollout.engine_tensor_parallel or use rollout.engine_hosts=ray")
        return visible[first:first + self.engine_width]

    def describe(self) -> str:
        """One line of who runs where, then the notes."""
        if not self.use_gpu:
            where = (f"CPU: policy {self.policy_ranks} rank(s)" + (f", critic {self.critic_ranks}" if self.critic_ranks
                                                                     else "")
                     + f", {self.num_engines} {self.engine} engine(s)")
        else:
            trainer = f"policy {self.policy_ranks}" + (f" + critic {self.critic_ranks}" if self.critic_ranks else "")
            if self.colocate:
                in_process = engine_kind(self.engine).in_process
                engines = (f"the {self.engine} engine on policy rank 0's GPU" if in_process else
                           f"{self.num_engines} {self.engine} engine(s) x {self.engine_width} GPU(s) on the "
                           "trainer's GPUs")
                engines += " (colocated)"
            else:
                engines = f"{self.num_engines} {self.engine} engine(s) x {self.engine_width} GPU(s) of their own"
            where = (f"{self.gpus_needed} of {self.gpus} GPU(s): {trainer} for the trainer, {engines}; weight sync "
                     f"{self.weight_sync}")
        return "\n".join([f"placement: {where}", *(f"placement: {note}" for note in self.notes)])


def gpus_asked(policy_ranks: int, critic: bool, rollout: Any) -> int:
    """GPUs the settings ask for on GPUs: the trainer's, plus the engines' own unless rollout.colocate=true."""
    engines = 0 if rollout.colocate else rollout.num_engines * rollout.engine_tensor_parallel
    return policy_ranks * (2 if critic else 1) + engines


def make_placement(policy_ranks: int, critic: bool, rollout: Any, gpus: int) -> Placement:
    """The placement of a run with `policy_ranks` policy ranks (and as many critic ranks with `critic`) and the
    `rollout` settings on a cluster of `gpus` GPUs; PlacementError when it cannot run there."""
    base = dict(gpus=gpus, policy_ranks=policy_ranks, critic_ranks=policy_ranks if critic else 0,
                engine=rollout.engine, num_engines=rollout.num_engines,
                engine_width=rollout.engine_tensor_parallel if gpus else 0, engine_hosts=rollout.engine_hosts)
    if not gpus:
        return Placement(**base, colocate=bool(rollout.colocate), weight_sync=rollout.weight_sync)
    separate = Placement(**base, colocate=False, weight_sync=rollout.weight_sync)
    if separate.trainer_gpus > gpus:
        critic_part = f" + critic {separate.critic_ranks}" if critic else ""
        raise PlacementError(f"{separate.trainer_gpus} GPUs needed for the trainer alone (policy {policy_ranks}"
                             f"{critic_part}: actor.parallel tensor x pipeline x context x data); this cluster has "
                             f"{gpus}: lower actor.parallel.* or add GPUs")
    colocate, notes = rollout.colocate, []
    why_not = _why_not_colocated(rollout, separate)
    if colocate is None:
        colocate = separate.gpus_needed > gpus and why_not is None
        if colocate:
            notes.append(f"rollout.colocate unset and {separate.gpus_needed} GPUs needed for separate engines "
                         f"({_counts(separate)}); this cluster has {gpus}: the engines are colocated with the trainer")
    if colocate and why_not is not None:
        raise PlacementError(f"rollout.colocate=true cannot run here: {why_not}")
    if not colocate and separate.gpus_needed > gpus:
        hint = ("set rollout.colocate=true or leave it unset" if why_not is None else
                f"the engines cannot be colocated ({why_not})")
        raise PlacementError(f"{separate.gpus_needed} GPUs needed: {_counts(separate)}; this cluster has {gpus}: "
                             f"{hint}, lower rollout.num_engines or rollout.engine_tensor_parallel, or add GPUs")
    weight_sync = rollout.weight_sync
    asked = get_strategy(weight_sync)
    if colocate and engine_kind(rollout.engine).processes and not asked.shares_gpu:
        weight_sync = _stand_in(rollout.engine) or weight_sync  # one there is: else not colocated (above)
        notes.append(f"rollout.weight_sync={asked.name} cannot run colocated on GPUs ({asked.gpu_note}): using "
                     f"rollout.weight_sync={weight_sync} ({get_strategy(weight_sync).summary})")
    return Placement(**base, colocate=colocate, weight_sync=weight_sync, notes=tuple(notes))


def _counts(placement: Placement) -> str:
    parts = [f"policy {placement.policy_ranks}"]
    if placement.critic_ranks:
        parts.append(f"critic {placement.critic_ranks}")
    width = f" x {placement.engine_width}" if placement.engine_width > 1 else ""
    parts.append(f"engines {placement.num_engines}{width}")
    return " + ".join(parts)


def _stand_in(engine: str) -> str | None:
    """The weight sync the placement takes in the user's place for colocated `engine` processes whose asked sync
    cannot share a GPU (the first registered stand-in reaching them there), or None."""
    return next((name for name in usable_strategies(engine, shared_gpu=True) if get_strategy(name).stand_in), None)


def _why_not_usable(engine: str) -> str:
    """Why each strategy that cannot reach `engine` processes on the trainer's GPUs cannot."""
    reasons = []
    for name, info in strategies().items():
        if not info.reaches(engine, shared_gpu=True):
            why = info.gpu_note if engine in info.engines else info.engines_note
            reasons.append(f"{name}: {why or f'not for rollout.engine={engine}'}")
    return "; ".join(reasons)


def _why_not_colocated(rollout: Any, separate: Placement) -> str | None:
    """Why the engines cannot share the trainer's GPUs, or None when they can."""
    if rollout.engine_hosts == "ray":
        return "rollout.engine_hosts=ray places engines on GPUs of their own (colocation needs engine_hosts=local)"
    if engine_kind(rollout.engine).in_process:
        return None
    if rollout.mode != "sync":
        return (f"rollout.mode={rollout.mode}: colocated engines release the GPU while the trainer trains, which "
                "needs rollout.mode=sync")
    asked = get_strategy(rollout.weight_sync)
    if not asked.reaches(rollout.engine, shared_gpu=True) and (asked.shares_gpu or not _stand_in(rollout.engine)):
        usable = usable_strategies(rollout.engine, shared_gpu=True)
        return (f"{engine_kind(rollout.engine).title} on the trainer's GPUs can take weights only from "
                f"{either(usable) or 'no weight sync'} here ({_why_not_usable(rollout.engine)}): set "
                f"rollout.weight_sync={either(usable)}")
    if separate.num_engines * separate.engine_width > separate.policy_ranks:
        return (f"{separate.num_engines} engine(s) x {separate.engine_width} GPU(s) do not fit on the policy's "
                f"{separate.policy_ranks} GPU(s)")
    return None
