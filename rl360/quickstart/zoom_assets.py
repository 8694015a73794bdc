"""The zoom quickstart's tiny Qwen2.5-VL (nothing is downloaded): random weights with two habits an instruct
vision-language model brings, neither of which tells an answer from the prompt's image alone.

- It calls `image_zoom_in_tool` on the mark first in about `CALL_PRIOR` of its replies (`prime_first_token`), the
  same for every colour: the prompt's image is one grey for all of them.
- After the crop comes back, it names the crop's colour right with probability about `READ_PRIOR`
  (`prime_answers` over the contexts the real agent loop and zoom tool produce after a call), as a model that
  has seen colours reads a clear crop. RL has to make calling a habit and the reading sure.
"""

from __future__ import annotations

import copy
from pathlib import Path
from types import ModuleType

from rl360.config import RunConfig

READ_PRIOR = 0.4


def build_zoom_quickstart_model(cfg: RunConfig, task: ModuleType, read_prior: float = READ_PRIOR) -> Path:
    """The model of `cfg.model.path` for the task script `task` (data_preprocess/synthetic_zoom.py: its QUESTION,
    CALL, REPLY, CALL_PRIOR, COLOURS and rows), primed with the run's own agent (`cfg.agent`); returns its
    directory."""
    from transformers import AutoTokenizer

    from rl360.agents.build import agent_from_config
    from rl360.data import PromptRenderer
    from rl360.quickstart.priming import answer_contexts, final_hidden_state, prime_answers
    from rl360.quickstart.vision_assets import build_vision_quickstart_model, prime_first_token

    model_dir = Path(cfg.model.path)
    build_vision_quickstart_model(model_dir, texts=[task.QUESTION, "tool"], seed=cfg.seed,
                                  added_tokens=[task.CALL, task.REPLY], max_answer=len(task.COLOURS))
    if read_prior:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        renderer = PromptRenderer.for_model(model_dir, tokenizer, max_prompt_length=1 << 20,
                                            min_pixels=cfg.model.min_pixels or None,
                                            max_pixels=cfg.model.max_pixels or None)
        rows = task.make_rows(len(task.COLOURS), "prime", seed=cfg.seed + 2)  # one per colour: the task's images
        with_tools = copy.deepcopy(cfg)
        with_tools.agent.loop = with_tools.agent.loop or "tools"  # zoom-control builds the same model
        agent = agent_from_config(with_tools)
        contexts = answer_contexts([renderer.prompt(row) for row in rows], tokenizer.convert_tokens_to_ids(task.CALL),
                                   tokenizer.eos_token_id, tokenizer, agent.tools, agent.parser, agent.settings)
        answers = tokenizer.convert_tokens_to_ids([f"\\boxed{{{row['reward_model']['ground_truth']}}}" for row in rows])
        prime_answers(model_dir, contexts, answers, read_prior, seed=cfg.seed)
        after_reply = final_hidden_state(model_dir, contexts)  # calling again there stays as rare as it was
    else:
        after_reply = None
    prime_first_token(model_dir, task.CALL, task.QUESTION, task.draw_image(1), task.CALL_PRIOR, keep=after_reply)
    return model_dir
