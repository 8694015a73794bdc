"""The prompts of an evaluation: rows of parquet files (the verl / Reasoning360 schema) or jsonl files.

A row's prompt is its `data.prompt_field`, or else the first of DeepVision's fields present (`messages`,
`prompt`, `question`, `text`, `problem`, `query`, `input`): a list of chat messages, or a string sent as
one user message. Its ground truth is `reward_model.ground_truth`, else `ground_truth`, else `answer`; its
`data_source` the row's, else `data.data_source`. A row without them is a `DataError` naming file and row.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from rl360.data.schema import DataError, extra_info_dict
from rl360.eval.config import PROMPT_FIELDS, EvalDataConfig


@dataclass
class EvalPrompt:
    index: int  # position over all files, in order
    messages: list[dict]
    data_source: str
    ground_truth: str
    extra_info: dict = field(default_factory=dict)
    row: dict | None = None  # evaluation during training: the held-out parquet row, as its sampler renders it

    def question(self) -> str:
        """The last user message's text (what a judge is shown as the question)."""
        users = [m.get("content", "") for m in self.messages if m.get("role") == "user"]
        return str(users[-1] if users else self.messages[-1].get("content", ""))


def read_prompts(data: EvalDataConfig) -> list[EvalPrompt]:
    prompts: list[EvalPrompt] = []
    for path in data.files:
        for row_number, row in _rows(Path(path)):
            if data.max_prompts and len(prompts) >= data.max_prompts:
                return prompts
            prompts.append(_prompt(row, len(prompts), f"{path} row {row_number}", data))
    if not prompts:
        raise DataError(f"data.files {data.files} hold no rows")
    return prompts


def _rows(path: Path):
    if not path.is_file():
        raise DataError(f"data file not found: {path}")
    if path.suffix == ".parquet":
        parquet = pq.ParquetFile(path)
        number = 0
        for group in range(parquet.num_row_groups):
            for row in parquet.read_row_group(group).to_pylist():
                yield number, row
                number += 1
        return
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path} line {number + 1}: not valid JSON ({err})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path} line {number + 1}: a JSON object expected")
            yield number, row


def _prompt(row: dict[str, Any], index: int, where: str, data: EvalDataConfig) -> EvalPrompt:
    fields = [data.prompt_field] if data.prompt_field else [f for f in PROMPT_FIELDS if row.get(f) is not None]
    if not fields or row.get(fields[0]) is None:
        wanted = f"field {data.prompt_field!r}" if data.prompt_field else \
            f"any of the fields {', '.join(PROMPT_FIELDS)}"
        raise DataError(f"{where}: no prompt: the row has no {wanted} (its fields: {sorted(row)}); set "
                        "data.prompt_field")
    value = row[fields[0]]
    if isinstance(value, str):
        messages = [{"role": "user", "content": value}]
    elif isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m and isinstance(
            m.get("content"), str) for m in value):
        messages = [{"role": m["role"], "content": m["content"]} for m in value]
    else:
        raise DataError(f"{where}: field {fields[0]!r} is neither a string nor a list of {{role, content}} messages")
    reward = row.get("reward_model")
    truth = reward.get("ground_truth") if isinstance(reward, dict) else None
    truth = next((v for v in (truth, row.get("ground_truth"), row.get("answer")) if v is not None), None)
    if truth is None:
        raise DataError(f"{where}: no ground truth (reward_model.ground_truth, ground_truth or answer)")
    source = row.get("data_source") or data.data_source
    if not source:
        raise DataError(f"{where}: no data_source: add the field, or set data.data_source (e.g. math__deepvision)")
    extra = extra_info_dict(row.get("extra_info"))
    return EvalPrompt(index, messages, str(source), truth if isinstance(truth, str) else json.dumps(truth),
                      extra if isinstance(extra, dict) else {})
