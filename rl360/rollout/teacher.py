"""A distillation teacher's log-probs of the student's samples (`distill.*`, docs/distillation.md).

The teacher is an engine on SGLang's `/generate` (SGLang, `rl360 serve rollout`, sglang-router). Each sample goes in
as `input_ids` (its prompt and response, tool replies included) with `max_new_tokens: 0`, `return_logprob: true`
and `logprob_start_len` at the prompt's end, at temperature 1; `meta_info.input_token_logprobs` then holds the
teacher's log-prob of each response token given everything before it. `distill.teacher_model` is served here
(`rl360 serve rollout` on this machine's CPU, its log `<output_dir>/rollout/teacher.log`); `distill.teacher_url` is
an engine already serving.

    teacher = await Teacher.open(cfg.distill, cfg.model, log_dir)   # ConfigError: tokenizers differ, ...
    logprobs = await teacher.logprobs(samples)   # per sample, per response token (0.0 on tool replies)
    await teacher.close()
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from rl360.config import ConfigError
from rl360.core import Sample
from rl360.core.client import EngineClient, EngineError
from rl360.rollout.engines import EngineProcess, engine_command, new_api_key

STARTUP_TIMEOUT_S = 600


class Teacher:
    def __init__(self, client: EngineClient, settings: Any, process: EngineProcess | None = None):
        self.client, self.settings, self.process = client, settings, process
        self._slots = asyncio.Semaphore(settings.max_concurrency)

    @classmethod
    async def open(cls, settings: Any, model: Any, log_dir: Path) -> Teacher:
        """The teacher of `settings` (the `distill` section) for the student `model` (the `model` section): served
        here from `teacher_model`, or reached at `teacher_url`; ConfigError when its tokenizer is not the
        student's."""
        process = None
        if settings.teacher_model:
            if not (Path(settings.teacher_model) / "config.json").is_file():
                raise ConfigError(f"distill.teacher_model={settings.teacher_model}: not a Hugging Face model "
                                  "directory (no config.json)")
            key = new_api_key()
            process = EngineProcess(0, engine_command("server", settings.teacher_model, model.dtype),
                                    Path(log_dir) / "teacher.log", key, STARTUP_TIMEOUT_S,
                                    env={"CUDA_VISIBLE_DEVICES": ""})
            url = await process.start()
        else:
            url, key = settings.teacher_url, os.environ.get(settings.api_key_env) or None
        teacher = cls(EngineClient(url, api_key=key, timeout_s=settings.timeout_s), settings, process)
        try:
            await teacher._check_tokenizer(model.path)
        except BaseException:
            await teacher.close()
            raise
        return teacher

    async def logprobs(self, samples: list[Sample]) -> list[list[float]]:
        """Per sample, the teacher's log-prob of each response token (0.0 where the sample's loss mask is 0: tokens
        a tool inserted, which are not trained on)."""
        for index, sample in enumerate(samples):
            if sample.images:
                raise ConfigError(f"distill.*: sample {index} has an image prompt; distillation takes text prompts "
                                  "only")
        asked = [sample for sample in samples if sample.response_ids]  # an empty response has nothing to score
        size = self.settings.sequences_per_request
        parts = await asyncio.gather(*(self._score(asked[start:start + size]) for start in range(0, len(asked), size)))
        scored = iter([values for part in parts for values in part])
        return [next(scored) if sample.response_ids else [] for sample in samples]

    async def _score(self, samples: list[Sample]) -> list[list[float]]:
        async with self._slots:
            replies = await self.client.generate(
                [list(s.prompt_ids) + list(s.response_ids) for s in samples],
                [{"max_new_tokens": 0, "temperature": 1.0} for _ in samples], return_logprob=True,
                logprob_start_len=[len(s.prompt_ids) for s in samples])
        if len(replies) != len(samples):
            raise EngineError("/generate", 200, f"the teacher answered {len(replies)} replies for {len(samples)} "
                                                "sequences", url=self.client.url)
        return [_response_logprobs(sample, reply, self.client.url) for sample, reply in zip(samples, replies)]

    async def _check_tokenizer(self, student_path: str) -> None:
        where = self.settings.teacher_tokenizer or self.settings.teacher_model
        if not where:
            where = (await self.client.model_info()).get("tokenizer_path") or ""
        if not where or not Path(where).is_dir():
            raise ConfigError(f"distill.teacher_url={self.settings.teacher_url}: cannot read the teacher's tokenizer "
                              f"({where or 'its /model_info names none'}); give its directory as "
                              "distill.teacher_tokenizer")
        mismatch = tokenizer_mismatch(student_path, where)
        if mismatch:
            raise ConfigError(f"distill: the teacher's tokenizer ({where}) is not the student's ({student_path}): "
                              f"{mismatch}; teacher and student must share a tokenizer")

    async def close(self) -> None:
        await self.client.close()
        if self.process is not None:
            self.process.stop()


def tokenizer_mismatch(student_path: str, teacher_path: str) -> str | None:
    """None when the two tokenizers map the same strings to the same ids, else the first difference in words."""
    student, teacher = (AutoTokenizer.from_pretrained(path) for path in (student_path, teacher_path))
    ours, theirs = student.get_vocab(), teacher.get_vocab()
    if len(ours) != len(theirs):
        return f"{len(ours)} tokens against {len(theirs)}"
    for token, index in sorted(ours.items(), key=lambda item: item[1]):
        if theirs.get(token) != index:
            return f"token {token!r} is id {index} for the student, {theirs.get(token)} for the teacher"
    return None


def _response_logprobs(sample: Sample, reply: dict, url: str) -> list[float]:
    entries = reply.get("meta_info", {}).get("input_token_logprobs") or []
    if [entry[1] for entry in entries] != list(sample.response_ids) or any(entry[0] is None for entry in entries):
        raise EngineError("/generate", 200, "the teacher's input_token_logprobs do not cover the "
                                            f"{len(sample.response_ids)} response tokens sent", url=url)
    mask = sample.loss_mask or [1] * len(entries)
    return [float(entry[0]) if keep else 0.0 for entry, keep in zip(entries, mask)]
