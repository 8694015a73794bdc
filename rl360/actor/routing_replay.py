"""MoE routing replay in the trainer (`actor.moe_routing_replay`, docs/moe-routing-replay.md).

The engines return the experts each token was routed to (`Sample.routed_experts`, SGLang's `routed_experts`); the
batch carries them as `routed_experts` `[rows, width, layers * top_k]`. Before each micro-batch's forward (the
old-log-prob pass and the update's), every router of the model chunk about to run is given its layer's routes in
megatron's token order (sequence-major: position s of row b is token s * rows + b; packed: the rows' slots back
to back) and told to replay them (megatron-core's `RouterReplay`, REPLAY_FORWARD): the gates still come from the
trainer's own router scores, gathered at the engine's experts. Positions the engine never ran (a response's last
token, padding) carry experts 0 .. top_k - 1; causal attention keeps them from every position that is trained on.
"""

from __future__ import annotations

import torch

from rl360.actor.batch import RolloutBatch


def megatron_order(batch: RolloutBatch, width: int, num_layers: int, top_k: int,
                   slots: list[int] | None = None) -> torch.Tensor:
    """`[tokens, num_layers, top_k]` routes of a micro-batch in the order its routers see the tokens: padded rows of
    `width` tokens (sequence-major), or, with `slots` (packing's slot lengths), the rows' slots back to back.
    Positions without the engine's routes (-1, or past the batch's width) get experts 0 .. top_k - 1."""
    routes = batch.routed_experts
    needed = max(width, *(slots or [0]))
    if routes.shape[1] < needed:
        routes = torch.nn.functional.pad(routes, (0, 0, 0, needed - routes.shape[1]), value=-1)
    if slots is None:
        ordered = routes[:, :width].transpose(0, 1).reshape(-1, routes.shape[-1])
    else:
        ordered = torch.cat([routes[row, :slot] for row, slot in enumerate(slots)])
    ordered = ordered.view(-1, num_layers, top_k).long()
    default = torch.arange(top_k, device=ordered.device).expand_as(ordered)
    return torch.where(ordered < 0, default, ordered)


class RoutingReplay:
    """Sets the routers of the model chunks it is given to replay routes, and clears them."""

    def __init__(self, num_layers: int, top_k: int):
        self.num_layers, self.top_k = num_layers, top_k
        self._routers: dict[int, list] = {}  # id(chunk) -> its routers

    def routers(self, chunk: torch.nn.Module) -> list:
        if id(chunk) not in self._routers:
            self._routers[id(chunk)] = [module for module in chunk.modules()
                                        if getattr(module, "router_replay", None) is not None]
        return self._routers[id(chunk)]

    def replay(self, chunk: torch.nn.Module, routes: torch.Tensor) -> None:
        """The chunk's routers replay `routes` (`[tokens, num_layers, top_k]`, megatron's token order) in its next
        forward, each its own layer's (megatron's `layer_number`: 1-based, across pipeline stages)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for router in self.routers(chunk):
            router.router_replay.clear_indices()
            router.router_replay.set_target_indices(routes[:, router.layer_number - 1].contiguous())
            router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def clear(self, chunks: list[torch.nn.Module]) -> None:
        """Every router of `chunks` back to routing by its own scores."""
        for chunk in chunks:
            for router in self.routers(chunk):
                router.router_replay.clear_indices()
                router.router_replay.clear_router_replay_action()
