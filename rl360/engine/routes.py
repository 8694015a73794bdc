"""The experts a mixture-of-experts model routed each token to, recorded while the engine decodes (routing replay,
docs/moe-routing-replay.md).

transformers' MoE routers (`Qwen2MoeTopKRouter`, `Qwen3MoeTopKRouter`: modules whose class name ends in
`TopKRouter`) return `(logits, scores, indices)`, `indices` the top-k experts of each token; a forward hook keeps
them while a `RouteRecorder.forward()` block runs. A sequence's routes are SGLang's `routed_experts`: one entry per
token that went through the model, the prompt's and every generated token but the last (prompt + response - 1
tokens), each `[num_hidden_layers, top_k]` expert ids (0 in a layer without experts); on the wire, the base64 of
the int32 array (`rl360.core.routes`).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import torch

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class RouteRecorder:
    def __init__(self, model: torch.nn.Module):
        config = getattr(model.config, "text_config", model.config)
        self.num_layers = int(config.num_hidden_layers)
        self.top_k = int(getattr(config, "num_experts_per_tok", 0) or 0)
        self._routers: dict[int, torch.nn.Module] = {}  # layer index -> its router
        for name, module in model.named_modules():
            found = _LAYER.search(name)
            if type(module).__name__.endswith("TopKRouter") and found:
                self._routers[int(found.group(1))] = module
        self._captured: dict[int, torch.Tensor] | None = None
        for layer, router in self._routers.items():
            router.register_forward_hook(self._hook(layer))

    @property
    def has_experts(self) -> bool:
        return bool(self._routers)

    def _hook(self, layer: int):
        def keep(module, inputs, output):
            if self._captured is not None:
                self._captured[layer] = output[2].detach()
        return keep

    @contextlib.contextmanager
    def forward(self, batch: int, width: int) -> Iterator[list[torch.Tensor]]:
        """Records one forward of `batch` rows of `width` tokens; the list it yields holds, after the block, the
        `[batch, width, num_layers, top_k]` routes (int16, on the CPU)."""
        self._captured = {}
        result: list[torch.Tensor] = []
        try:
            yield result
            routes = torch.zeros((batch * width, self.num_layers, self.top_k), dtype=torch.int16)
            for layer, indices in self._captured.items():
                routes[:, layer] = indices.reshape(batch * width, self.top_k).to("cpu", torch.int16)
            result.append(routes.view(batch, width, self.num_layers, self.top_k))
        finally:
            self._captured = None


def sequence_routes(prefill: torch.Tensor, steps: list[torch.Tensor], row: int, prompt_length: int,
                    generated: int) -> torch.Tensor:
    """Row `row`'s routes, `[prompt_length + generated - 1, layers * top_k]` (`Sample.routed_experts`): its prompt's
    from the left-padded prefill's, then those of its generated tokens fed back (decode step k feeds the token
    drawn at step k - 1)."""
    parts = [prefill[row, prefill.shape[1] - prompt_length:]]
    parts += [step[row] for step in steps[:max(generated - 1, 0)]]
    return torch.cat(parts)[:prompt_length + generated - 1].flatten(1)
