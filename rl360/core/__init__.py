"""The bottom floor: the types every other room shares, importing nothing of rl360 above them.

- `prompt`: what engines sample from (`Prompt`: token ids, or an `ImagePrompt` with its images).
- `sampling`: `SamplingParams`, one call's sampling settings.
- `trajectory`: `Sample`, one sampled trajectory (a single response is its one-turn case), with its `Turn`s.
- `wire`: the "rl360_safetensors" weight bucket format, which the engine client sends and engines read.
- `routes`: SGLang's wire form of a mixture-of-experts model's routed experts (routing replay).
- `engine_kinds`: the kinds of rollout engine (`rollout.engine`) and what each can do (`ENGINE_KINDS`).
- `client`: `EngineClient`, the trainer's side of SGLang's native HTTP API (engines, fleet and weight sync use it).
"""

from rl360.core.prompt import ImagePrompt, Prompt, prompt_ids, prompt_images
from rl360.core.sampling import SamplingParams
from rl360.core.trajectory import TRAJECTORY_ENDINGS, Sample, TrajectorySummary, Turn

__all__ = ["TRAJECTORY_ENDINGS", "ImagePrompt", "Prompt", "SamplingParams", "Sample", "TrajectorySummary", "Turn",
           "prompt_ids", "prompt_images"]
