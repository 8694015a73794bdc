"""Write the tools quickstart task, `a*b%7` of two random 6-digit numbers, as parquet in the standard (verl) schema.

Each prompt is one user message such as "123456*654321%7"; the ground truth is the residue ("3"), checked by the
`math` reward (math-verify on the last \\boxed{} of the response). Neither number is a multiple of 7, so the
answers 1..6 are equally likely (guessing scores 1/6). Each row starts the python tool with `a` and `b` bound
(verl's per-tool `extra_info.tools_kwargs.python.create_kwargs`, here `{"variables": {"a": ..., "b": ...}}`).
`data_source` is `math__synthetic_tools`, scored by the math reward's accuracy; `--tool-bonus` adds DeepEyes' tool
bonus when a tool was called and the answer is right (`extra_info.reward_metric: tool_bonus`).

`--traces` writes conversations for `rl360 sft` instead (docs/sft.md), in verl's multi-turn SFT format: `messages`
(the user's prompt, the assistant's python call, the tool's printed answer, the assistant repeating it) and `tools`
(the python tool's spec, as JSON).

    python -m data_preprocess.synthetic_tools --out data/tools
    python -m data_preprocess.synthetic_tools --out data/tools_sft --traces --train-rows 1024 --test-rows 64
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from data_preprocess.synthetic_arithmetic import write_parquet

DATA_SOURCE = "math__synthetic_tools"
MODULUS = 7


def make_rows(count: int, split: str, seed: int, modulus: int = MODULUS, tool_bonus: bool = False) -> list[dict]:
    """`count` rows of two 6-digit numbers, neither a multiple of `modulus`, drawn with `seed`."""
    metric = {"reward_metric": "tool_bonus"} if tool_bonus else {}
    rng = random.Random(seed)

    def draw() -> int:
        while (value := rng.randint(100_000, 999_999)) % modulus == 0:
            pass
        return value

    rows = []
    for index in range(count):
        a, b = draw(), draw()
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"{a}*{b}%{modulus}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(a * b % modulus)},
            "extra_info": {"split": split, "index": index, **metric,
                           "tools_kwargs": {"python": {"create_kwargs": {"variables": {"a": a, "b": b}}}}},
        })
    return rows


PYTHON_TOOL = {"type": "function", "function": {
    "name": "python", "description": "Run Python code; `a` and `b` are bound to the question's numbers",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}


def make_traces(count: int, split: str, seed: int, modulus: int = MODULUS) -> list[dict]:
    """`count` conversations that solve rows of `make_rows` with the python tool: the quickstart's one-token call
    (`rl360.quickstart.tools_assets.CALL`), the reply it prints, the answer repeated."""
    from rl360.quickstart.tools_assets import CALL

    traces = []
    for row in make_rows(count, split, seed, modulus):
        answer = f"\\boxed{{{row['reward_model']['ground_truth']}}}"
        traces.append({"messages": [*row["prompt"], {"role": "assistant", "content": CALL},
                                    {"role": "tool", "content": answer}, {"role": "assistant", "content": answer}],
                       "tools": json.dumps([PYTHON_TOOL])})
    return traces


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="data/tools", help="output directory")
    parser.add_argument("--train-rows", type=int, default=20_000, help="rows in train.parquet")
    parser.add_argument("--test-rows", type=int, default=500, help="rows in test.parquet")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tool-bonus", action="store_true", help="score with DeepEyes' tool bonus too")
    parser.add_argument("--traces", action="store_true", help="write tool-calling conversations for rl360 sft")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.traces:
        write_parquet(make_traces(args.train_rows, "train", args.seed + 10), out / "train.parquet")
        write_parquet(make_traces(args.test_rows, "test", args.seed + 11), out / "test.parquet")
        print(f"wrote {out / 'train.parquet'} and {out / 'test.parquet'} (conversations)")
        return
    write_parquet(make_rows(args.train_rows, "train", args.seed, tool_bonus=args.tool_bonus), out / "train.parquet")
    write_parquet(make_rows(args.test_rows, "test", args.seed + 1, tool_bonus=args.tool_bonus), out / "test.parquet")
    print(f"wrote {out / 'train.parquet'} and {out / 'test.parquet'}")


if __name__ == "__main__":
    main()
