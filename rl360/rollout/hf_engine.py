"""The embedded rollout engine: Hugging Face transformers, in-process, CPU or GPU.

Sampling is a plain KV-cached decode loop over a left-padded batch, so the log-prob of every sampled
token comes from exactly the distribution it was drawn from (temperature applied, before top-k/top-p).
Temperature 0 decodes greedily (the most likely token at every step, no randomness); its log-probs are
those of the model's plain distribution (temperature 1).
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from rl360.rollout.base import Sample, SamplingParams, WeightBucket


class HFEngine:
    def __init__(self, model_path: str, dtype: torch.dtype = torch.float32, device: str | None = None,
                 num_threads: int = 0):
        if num_threads:
            torch.set_num_threads(num_threads)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(self.device).eval()
        self.pad_id = 0
        self.version = 0
        self._params = dict(self.model.named_parameters())
        self._loaded: set[str] = set()

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Sample]]:
        if params.temperature < 0:
            raise ValueError(f"temperature={params.temperature} must be >= 0 (0: greedy decoding)")
        expanded = [p for p in prompts for _ in range(params.n)]
        generator = torch.Generator(device=self.device).manual_seed(params.seed)
        tokens, logprobs, finished = self._decode(expanded, params, generator)
        samples = []
        for i, prompt in enumerate(expanded):
            length = int(finished[i]) if finished[i] > 0 else tokens.shape[1]
            samples.append(Sample(
                prompt_ids=list(prompt),
                response_ids=tokens[i, :length].tolist(),
                logprobs=logprobs[i, :length].tolist(),
                finish_reason="stop" if finished[i] > 0 else "length",
                weight_version=self.version,
            ))
        return [samples[i * params.n:(i + 1) * params.n] for i in range(len(prompts))]

    def _decode(self, prompts: list[list[int]], params: SamplingParams, generator: torch.Generator):
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        stop = torch.tensor(params.stop_token_ids or [-1], device=self.device)
        # finished[i] = response length once a stop token was sampled, 0 while still running
        finished = torch.zeros(len(prompts), dtype=torch.long, device=self.device)
        out_tokens, out_logprobs = [], []
        cache, step_ids = None, ids
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        for step in range(params.max_new_tokens):
            output = self.model(input_ids=step_ids, attention_mask=mask, position_ids=positions,
                                past_key_values=cache, use_cache=True)
            cache = output.past_key_values
            logits = output.logits[:, -1, :].float()
            if params.temperature > 0:
                logits = logits / params.temperature
                token = torch.multinomial(_filtered_probs(logits, params), 1, generator=generator).squeeze(-1)
            else:  # greedy
                token = logits.argmax(dim=-1)
            logp = torch.log_softmax(logits, dim=-1)
            running = finished == 0
            token = torch.where(running, token, torch.full_like(token, self.pad_id))
            out_tokens.append(token)
            out_logprobs.append(torch.where(running, logp.gather(-1, token[:, None]).squeeze(-1), 0.0))
            finished = torch.where(running & torch.isin(token, stop), step + 1, finished)
            if bool((finished > 0).all()):
                break
            step_ids = token[:, None]
            mask = torch.cat([mask, running.long()[:, None]], dim=-1)
            positions = positions[:, -1:] + 1
        return torch.stack(out_tokens, 1).cpu(), torch.stack(out_logprobs, 1).cpu(), finished.cpu()

    def update_weights(self, bucket: WeightBucket, version: int) -> None:
        if version < self.version:  # newer versions may skip numbers (a resumed run starts at its step)
            raise ValueError(f"weight version {version} is older than the served version {self.version}")
        with torch.no_grad():
            for name, tensor in bucket:
                if name not in self._params:
                    raise KeyError(f"weight {name!r} is not a parameter of the engine's model")
                target = self._params[name]
                if target.shape != tensor.shape:
                    raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)} != engine's {tuple(target.shape)}")
                target.copy_(tensor.to(device=target.device, dtype=target.dtype))
                self._loaded.add(name)

    def finish_weight_update(self, version: int) -> int:
        missing = sorted(set(self._params) - self._loaded)  # tied weights appear once in _params
        self._loaded.clear()
        if missing:
            raise RuntimeError(f"weight update {version} left parameters unset: {missing[:8]}")
        self.version = version
        return self.version

    def health(self) -> dict:
        return {"version": self.version, "device": str(self.device), "engine": "hf"}


def _filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Softmax of temperature-scaled logits after top-k and top-p truncation."""
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        keep = sorted_probs.cumsum(-1) - sorted_probs < params.top_p
        sorted_probs = sorted_probs * keep
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return probs
