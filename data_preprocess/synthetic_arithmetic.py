"""Write the quickstart task, single-digit addition, as parquet in the standard (verl) schema.

Each prompt is one user message such as "7+2"; the ground truth is the sum ("9"), checked by the `math`
reward (math-verify on the last \\boxed{} of the response). `data_source` is `math__synthetic_arithmetic`.

    python data_preprocess/synthetic_arithmetic.py --out data/arithmetic --max-a 9 --max-b 9
"""

from __future__ import annotations

import argparse
import itertools
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

DATA_SOURCE = "math__synthetic_arithmetic"


def make_rows(max_a: int, max_b: int, split: str, copies: int, seed: int) -> list[dict]:
    """Every (a, b) pair with a <= max_a, b <= max_b, `copies` times over, shuffled with `seed`."""
    pairs = list(itertools.product(range(max_a + 1), range(max_b + 1))) * copies
    random.Random(seed).shuffle(pairs)
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"{a}+{b}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"split": split, "index": index, "a": a, "b": b},
        }
        for index, (a, b) in enumerate(pairs)
    ]


def write_parquet(rows: list[dict], path: Path, row_group_size: int = 256) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="data/arithmetic", help="output directory")
    parser.add_argument("--max-a", type=int, default=9, help="largest first operand")
    parser.add_argument("--max-b", type=int, default=9, help="largest second operand")
    parser.add_argument("--copies", type=int, default=20, help="times each pair appears in train.parquet")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.out)
    write_parquet(make_rows(args.max_a, args.max_b, "train", args.copies, args.seed), out / "train.parquet")
    write_parquet(make_rows(args.max_a, args.max_b, "test", 1, args.seed + 1), out / "test.parquet")
    print(f"wrote {out / 'train.parquet'} and {out / 'test.parquet'}")


if __name__ == "__main__":
    main()
