"""Ten more everyday mistakes, each ending in at most 5 lines of stderr, exit status 2 and no traceback, naming
what to fix (the kin of the ones in tests/test_cli_errors.py). Each runs the `rl360` command line in a
subprocess; they run side by side in one module fixture, and each is refused before anything slow starts."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rl360.installed import has_package
from tests.test_cli_errors import REPO, _cli, _model, _rows

QUICKSTART = str(REPO / "configs" / "quickstart.yaml")


def _mistakes(tmp: Path) -> dict[str, tuple[tuple[str, ...], str]]:
    """name -> (rl360 arguments, the line it must end with: `...` stands for the paths below)."""
    model = _model(tmp / "model")
    data = tmp / "train.parquet"
    pq.write_table(pa.Table.from_pylist(_rows(20)), data)
    jsonl = tmp / "train.jsonl"
    jsonl.write_text("\n".join(json.dumps(row) for row in _rows(3)) + "\n")
    images = tmp / "images.parquet"  # one image path per row where a list of images belongs
    pq.write_table(pa.Table.from_pylist([dict(row, images=f"img/{i}.png") for i, row in enumerate(_rows(6))]),
                   images)
    used = tmp / "converted"
    used.mkdir()
    (used / "keep.txt").write_text("an earlier conversion")
    train = ("train", QUICKSTART, f"model.path={model}", f"data.train_files={data}", f"output_dir={tmp / 'out'}")
    return {
        "reward.custom module missing": (
            (*train, "reward.custom={my_task: 'my_rewards:score'}"),
            "rl360: config error: reward.custom.my_task='my_rewards:score': reward reference 'my_rewards:score': "
            "cannot import 'my_rewards': No module named 'my_rewards'"),
        "reward.custom function missing": (
            (*train, "reward.custom={my_task: 'tests.helpers:no_such_score'}"),
            "rl360: config error: reward.custom.my_task='tests.helpers:no_such_score': reward reference "
            "'tests.helpers:no_such_score': module 'tests.helpers' has no 'no_such_score'"),
        "data file missing": (
            ("train", QUICKSTART, f"model.path={model}", f"data.train_files={tmp / 'nope.parquet'}"),
            f"rl360: data error: {tmp / 'nope.parquet'}: no such file or directory"),
        "jsonl instead of parquet": (
            ("train", QUICKSTART, f"model.path={model}", f"data.train_files={jsonl}", f"output_dir={tmp / 'out'}"),
            f"rl360: data error: {jsonl}: rl360 reads parquet files, not json: convert it first, e.g. python -c "
            f"\"import pandas as pd; pd.read_json('{jsonl}', lines=True).to_parquet('{tmp / 'train'}.parquet')\""),
        "image column wrong": (
            ("train", QUICKSTART, f"model.path={model}", f"data.train_files={images}", f"output_dir={tmp / 'out'}"),
            f"rl360: data error: {images}: column 'images' has type string, expected a list of {{bytes, path}} "
            "images (or one {bytes, path} image)"),
        "unknown algorithm": (
            (*train, "algorithm.adv_estimator=grpoo"),
            "rl360: config error: algorithm.adv_estimator='grpoo': unknown advantage estimator 'grpoo'; choose one "
            "of ['gae', 'gpg', 'grpo', 'grpo_passk', 'opo', 'reinforce_plus_plus', 'reinforce_plus_plus_baseline', "
            "'remax', 'rloo'] or give 'package.module:function'"),
        "negative batch size": (
            (*train, "data.batch_size=-4"), "rl360: config error: data.batch_size=-4 must be > 0"),
        "a number that is not one": (
            (*train, "trainer.total_steps=ten"),
            f"rl360: config error: {QUICKSTART}: bad value for 'trainer.total_steps': Value 'ten' of type 'str' "
            "could not be converted to Integer"),
        "an engine rl360 does not have": (
            (*train, "rollout.engine=vllm"),
            "rl360: config error: rollout.engine='vllm' is not allowed; choose one of ['hf', 'server', 'sglang']"),
        "SGLang engines where SGLang is not installed": (
            (*train, "rollout.engine=sglang"),
            "rl360: config error: rollout.engine=sglang needs SGLang, which is not installed here: pip install "
            "'rl360[gpu]' (sglang==0.5.17, transformer-engine==2.11.0: launchers/versions.env); or use "
            "rollout.engine=server (rl360 serve rollout: SGLang's API on the HF engine, CPU or GPU)"),
        "Transformer Engine attention where it is not installed": (
            (*train, "model.attention=te"),
            "rl360: config error: model.attention=te needs Transformer Engine, which is not installed here: pip "
            "install 'rl360[gpu]' (sglang==0.5.17, transformer-engine==2.11.0: launchers/versions.env); or use "
            "model.attention=auto (Transformer Engine where it runs, else torch)"),
        "SGLang eval engines where SGLang is not installed": (
            ("eval", str(REPO / "configs" / "eval" / "quickstart.yaml"), "--model", str(model), "eval.engine=sglang"),
            "rl360: config error: eval.engine=sglang needs SGLang, which is not installed here: pip install "
            "'rl360[gpu]' (sglang==0.5.17, transformer-engine==2.11.0: launchers/versions.env); or use "
            "eval.engine=server (rl360 serve rollout: SGLang's API on the HF engine, CPU or GPU)"),
        "a preset that is not there": (
            (*train, "configs/algorithms/grpoo.yaml"),
            "rl360: config error: config file not found: configs/algorithms/grpoo.yaml"),
        "an override without a value": (
            (*train, "trainer.total_steps"),
            "rl360: config error: override 'trainer.total_steps' is not of the form key=value"),
        "convert into a directory already used": (
            ("convert", "hf-to-megatron", "--hf", str(model), "--out", str(used)),
            f"rl360: error: --out {used} already exists and is not empty; give a new directory (or remove that one)"),
        "convert from a checkpoint that is not there": (
            ("convert", "megatron-to-hf", "--ckpt", str(tmp / "no_ckpt"), "--out", str(tmp / "hf")),
            f"rl360: error: {tmp / 'no_ckpt'}/rl360.json not found (--ckpt must be a checkpoint written by `rl360 "
            "convert hf-to-megatron`, or one the trainer wrote: its step directory, its policy/ directory or the "
            "checkpoints directory)"),
    }


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """name -> (the completed `rl360` process, the line it must end with), all run side by side."""
    tmp = tmp_path_factory.mktemp("mistakes")
    mistakes = _mistakes(tmp)
    with ThreadPoolExecutor(2) as threads:
        done = {name: threads.submit(_cli, *args, cwd=REPO, unset=("RL360_DEBUG", "RL360_MODEL_PATH"))
                for name, (args, _) in mistakes.items()}
        return {name: (future.result(), mistakes[name][1]) for name, future in done.items()}


MISTAKES = [
    "reward.custom module missing", "reward.custom function missing", "data file missing",
    "jsonl instead of parquet", "image column wrong", "unknown algorithm", "negative batch size",
    "a number that is not one", "an engine rl360 does not have", "a preset that is not there",
    *(["SGLang engines where SGLang is not installed", "SGLang eval engines where SGLang is not installed"]
      if not has_package("sglang") else []),
    *(["Transformer Engine attention where it is not installed"] if not has_package("transformer_engine") else []),
    "an override without a value", "convert into a directory already used",
    "convert from a checkpoint that is not there",
]


def test_every_mistake_is_run(refused):
    assert sorted(MISTAKES) == sorted(name for name in refused if name in MISTAKES)


@pytest.mark.parametrize("name", MISTAKES)
def test_mistake_ends_in_one_short_message_and_exit_2(refused, name):
    done, line = refused[name]
    assert done.returncode == 2, (name, done.stderr[-2000:])
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert 1 <= len(lines) <= 5, done.stderr
    assert lines[-1] == line
