"""The kinds of rollout engine (`rollout.engine`) and what each can do: one table, `ENGINE_KINDS`, which the
config's checks, the placement, the memory plan, the engine fleet and the weight-sync strategies ask instead of
comparing names. The engines themselves are `rl360.rollout.engines` (the `Engine` protocol: each engine carries
its kind's `EngineKind` as `capabilities`); this table imports nothing (no SGLang, no torch), so the config reads
it while it validates.

    kind = engine_kind(cfg.rollout.engine)
    if kind.in_process: ...             # one engine in a Ray actor: no HTTP, weights through Ray
    extra = [kind.routes_flag] if kind.routes_flag else []
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineKind:
    name: str  # the `rollout.engine` value
    title: str  # how a message names its engines ("SGLang engines")
    summary: str  # one line for the config reference
    # one engine inside a Ray actor beside the trainer: no HTTP server (no router in front), weights as Ray objects
    # (no `rollout.weight_sync`), nothing to pause, release or restart; on GPUs it shares policy rank 0's GPU when
    # colocated. False: engine processes behind SGLang's HTTP API, as many as `rollout.num_engines`
    in_process: bool
    gpu_only: bool = False  # runs on CUDA GPUs only
    # takes `model.min_pixels` / `model.max_pixels` on its command line (False: from the model's
    # preprocessor_config.json)
    pixel_flags: bool = True
    routes_flag: str = ""  # the command-line flag that lets it return MoE routes ("": it returns them when asked)
    # takes `rollout.mem_fraction` of its GPUs at start (weights and a KV cache pool), which the memory plan
    # reports against a step's tokens
    static_memory: bool = False

    @property
    def processes(self) -> bool:
        """Engine processes behind an HTTP server (the contrary of `in_process`)."""
        return not self.in_process


ENGINE_KINDS: dict[str, EngineKind] = {kind.name: kind for kind in (
    EngineKind("hf", "hf engines", "one transformers engine inside a Ray actor (the smallest setup)",
               in_process=True),
    EngineKind("server", "rl360 serve rollout engines",
               "`rl360 serve rollout` processes behind SGLang's HTTP API", in_process=False),
    EngineKind("sglang", "SGLang engines", "`python -m sglang.launch_server` processes (GPU)", in_process=False,
               gpu_only=True, pixel_flags=False, routes_flag="--enable-return-routed-experts", static_memory=True),
)}


def engine_kind(name: str) -> EngineKind:
    """The kind named `name`; KeyError naming the kinds there are."""
    try:
        return ENGINE_KINDS[name]
    except KeyError:
        raise KeyError(f"no engine kind {name!r}; the kinds are {', '.join(ENGINE_KINDS)}") from None


def engine_names(where: str = "all") -> tuple[str, ...]:
    """The kinds' names: "all", or those running as engine "processes"."""
    return tuple(name for name, kind in ENGINE_KINDS.items() if where == "all" or kind.processes)


def engine_summaries() -> dict[str, str]:
    """Each kind's one-line summary, by name (the config reference's allowed values)."""
    return {name: kind.summary for name, kind in ENGINE_KINDS.items()}


def either(names: tuple[str, ...] | list[str]) -> str:
    """`a`, `a or b`, `a, b or c`: the names as a message lists alternatives."""
    names = list(names)
    return " or ".join(names) if len(names) < 3 else f"{', '.join(names[:-1])} or {names[-1]}"
