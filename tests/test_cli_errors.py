"""Mistakes a user can fix end in one `rl360: KIND: ...` line and exit status 2, before anything slow starts:
config keys, model directories, data rows, convert layouts, ports and keys of the services."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rl360.cli import main
from rl360.convert import check_layout
from rl360.errors import UserError, run_command
from rl360.model_dir import ModelDirError, check_model_dir
from rl360.rewards.check import check_reward_data

REPO = Path(__file__).resolve().parents[1]


def _cli(*args: str, cwd: Path = REPO, env: dict[str, str] | None = None,
         unset: tuple[str, ...] = ("RL360_DEBUG",)) -> subprocess.CompletedProcess:
    """`rl360 ARGS` in a subprocess, with `env` added to the environment and the `unset` variables removed."""
    environ = {key: value for key, value in os.environ.items() if key not in unset}
    environ.update({"PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore", **(env or {})})
    return subprocess.run([sys.executable, "-m", "rl360.cli", *args], cwd=cwd, env=environ, capture_output=True,
                          text=True, timeout=300)


def _last_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    return done.stderr.strip().splitlines()[-1]


def _rows(count: int) -> list[dict]:
    return [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"{i}+1"}],
             "reward_model": {"style": "rule", "ground_truth": str(i + 1)}} for i in range(count)]


def _model(path: Path, weights: str = "model.safetensors", tokenizer: tuple[str, ...] = ("tokenizer.json",)) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"num_attention_heads": 12, "num_key_value_heads": 4,
                                                  "intermediate_size": 96, "num_hidden_layers": 6}))
    if weights:
        (path / weights).write_bytes(b"\0")
    for name in tokenizer:
        (path / name).write_text("{}")
    return path


# ----- the command line: one line, exit 2, traceback on request ---------------------------------------------------


def test_quickstart_config_before_its_assets_says_run_quickstart(tmp_path):
    done = _cli("train", str(REPO / "configs" / "quickstart.yaml"), cwd=tmp_path)
    assert _last_line(done) == ("rl360: error: model.path=outputs/quickstart_assets/model does not exist yet: run "
                                "`rl360 quickstart` first, which builds the quickstart's model and data (then "
                                "`rl360 train` can use them)")


def test_debug_flag_and_environment_show_the_traceback(tmp_path):
    args = ("train", str(REPO / "configs" / "quickstart.yaml"), "trainer.total_epochs=3")
    line = ("rl360: config error: override 'trainer.total_epochs=3': unknown config key 'trainer.total_epochs' "
            "(verl's): rl360 counts steps, not epochs: set trainer.total_steps; one epoch is the rows divided by "
            "data.batch_size")
    assert _last_line(_cli(*args, cwd=tmp_path)) == line
    for done in (_cli("--debug", *args, cwd=tmp_path), _cli(*args, cwd=tmp_path, env={"RL360_DEBUG": "1"})):
        assert done.returncode == 2 and "Traceback" in done.stderr and "ConfigError" in done.stderr
        assert done.stderr.strip().splitlines()[-1] == line


def test_template_without_its_environment_names_the_variable():
    done = _cli("plan", "configs/templates/qwen2.5-7b-1node.yaml",
                unset=("RL360_DEBUG", "RL360_MODEL_PATH", "RL360_DATA_DIR"))
    assert _last_line(done) == (
        "rl360: config error: configs/templates/qwen2.5-7b-1node.yaml: environment variables not set: model.path "
        "reads RL360_MODEL_PATH, data.train_files reads RL360_DATA_DIR: export RL360_MODEL_PATH=... "
        "RL360_DATA_DIR=... or pass model.path=... data.train_files=... on the command line")


@pytest.mark.parametrize("where", ["under a regular file", "under /proc", "under /sys"])
def test_an_output_dir_that_cannot_be_written_is_refused_before_anything_starts(tmp_path, where):
    """Checked first: the model directory here does not exist, and the path is what is reported."""
    (tmp_path / "notes.txt").write_text("a file\n")
    out, blocked, reason = {
        "under a regular file": (tmp_path / "notes.txt" / "run", tmp_path / "notes.txt", "is not a directory"),
        "under /proc": (Path("/proc/rl360-test/run"), Path("/proc"), "nothing can be created in /proc ("),
        "under /sys": (Path("/sys/rl360-test/run"), Path("/sys"), "nothing can be created in /sys ("),
    }[where]
    done = _cli("train", str(REPO / "configs" / "quickstart.yaml"), f"output_dir={out}", cwd=tmp_path)
    assert done.stdout == ""
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"rl360: config error: output_dir: cannot write {out}: ") and reason in line, line
    assert str(blocked) in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]  # nothing written, nothing started


@pytest.mark.parametrize("name, key", [("checkpoints", "output_dir (its checkpoints)"),
                                       ("hf", "trainer.save_hf (the model's export)")])
def test_a_run_directory_that_is_a_file_is_refused(tmp_path, name, key):
    out = tmp_path / "out"
    out.mkdir()
    (out / name).write_text("not a directory\n")
    done = _cli("train", str(REPO / "configs" / "quickstart.yaml"), f"output_dir={out}", cwd=tmp_path)
    assert _last_line(done) == f"rl360: config error: {key}: cannot write {out / name}: {out / name} is not a " \
                               "directory"
    assert sorted(p.name for p in out.iterdir()) == [name]


def test_bad_rows_deep_in_the_file_stop_train_before_ray(tmp_path):
    rows = _rows(300)
    for index in (7, 150, 151, 152, 280, 299):
        rows[index]["reward_model"] = {"style": "rule", "ground_truth": None}
    data = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data, row_group_size=50)
    model = _model(tmp_path / "model")
    done = _cli("train", str(REPO / "configs" / "quickstart.yaml"), f"model.path={model}",
                f"data.train_files={data}", f"output_dir={tmp_path / 'out'}", cwd=tmp_path)
    assert _last_line(done) == (
        f"rl360: data error: 6 of 300 rows would stop the run when reached: {data}: 6 rows (7, 150, 151, 152, 280, "
        f"...). The first: {data} row 7: key 'reward_model.ground_truth' is missing (reward_model is {{'style': "
        "'rule', 'ground_truth': None}). Fix the rows, or set data.on_bad_row=skip to leave them out")
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_run_command_maps_user_errors_and_keeps_bugs(capsys, monkeypatch):
    monkeypatch.delenv("RL360_DEBUG", raising=False)

    def refuse(_):
        raise UserError("flag --x: must be 1")

    assert run_command(refuse, None) == 2
    assert capsys.readouterr().err == "rl360: error: flag --x: must be 1\n"

    def exits(_):
        raise SystemExit("serve: cannot listen")

    assert run_command(exits, None) == 2 and capsys.readouterr().err == "rl360: error: serve: cannot listen\n"

    def bug(_):
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):  # not a user error: the traceback stays
        run_command(bug, None)
    with pytest.raises(SystemExit) as code:  # a plain exit status passes through
        run_command(lambda _: sys.exit(3), None)
    assert code.value.code == 3
    monkeypatch.setenv("RL360_DEBUG", "1")
    assert run_command(refuse, None) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.endswith("rl360: error: flag --x: must be 1\n")


# ----- model directories ----------------------------------------------------------------------------------------


def test_model_dir_names_what_is_missing(tmp_path):
    assert check_model_dir(_model(tmp_path / "ok")) == tmp_path / "ok"
    check_model_dir(_model(tmp_path / "slow", "pytorch_model.bin", ("tokenizer_config.json", "vocab.json")))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelDirError) as err:
        check_model_dir(empty)
    assert str(err.value) == (f"model.path={empty} is not a complete Hugging Face model directory: it lacks "
                              "config.json; weights (*.safetensors or *.bin files, or an index naming them); a "
                              "tokenizer (tokenizer.json, or tokenizer_config.json with its vocabulary files)")
    check_model_dir(_model(tmp_path / "notok", tokenizer=()), "--hf", tokenizer=False)
    with pytest.raises(ModelDirError, match=r"it lacks a tokenizer \(tokenizer\.json, or tokenizer_config\.json"):
        check_model_dir(_model(tmp_path / "config_only", tokenizer=("tokenizer_config.json",)))
    with pytest.raises(ModelDirError, match=r"it lacks weights"):  # training_args.bin holds no weights
        check_model_dir(_model(tmp_path / "args", "training_args.bin"))
    sharded = _model(tmp_path / "sharded", "model-00001-of-00002.safetensors")
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(ModelDirError, match=r"lacks weight shards that model\.safetensors\.index\.json names: "
                                            r"model-00002-of-00002\.safetensors$"):
        check_model_dir(sharded)
    (sharded / "model-00002-of-00002.safetensors").write_bytes(b"\0")
    check_model_dir(sharded)
    with pytest.raises(ModelDirError, match=r"is a file; give the Hugging Face model directory"):
        check_model_dir(tmp_path / "ok" / "config.json")


def test_hub_id_is_refused_at_once_with_the_download_command(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelDirError) as err:
        check_model_dir("Qwen/Qwen2.5-7B-Instruct")
    assert str(err.value) == (
        "model.path=Qwen/Qwen2.5-7B-Instruct: no such directory, and rl360 does not download models: it takes a "
        "local directory. Download it first, e.g. `huggingface-cli download Qwen/Qwen2.5-7B-Instruct --local-dir "
        "models/Qwen2.5-7B-Instruct`, and set model.path to that directory")
    with pytest.raises(ModelDirError, match=r"^model\.path=nowhere/at/all: no such directory \(a local"):
        check_model_dir("nowhere/at/all")


# ----- data rows --------------------------------------------------------------------------------------------------


def test_data_check_counts_bad_rows_across_files(tmp_path, capsys):
    first, second = tmp_path / "a.parquet", tmp_path / "b.parquet"
    pq.write_table(pa.Table.from_pylist(_rows(20)), first, row_group_size=5)
    rows = _rows(40)
    rows[3]["prompt"] = []
    rows[33]["reward_model"] = {"style": "rule", "ground_truth": None}
    pq.write_table(pa.Table.from_pylist(rows), second, row_group_size=8)
    assert check_reward_data([str(first)], judge_configured=False)  # a clean file passes
    with pytest.raises(UserError) as err:
        check_reward_data([str(first), str(second)], judge_configured=False)
    assert str(err.value).startswith(f"2 of 60 rows would stop the run when reached: {second}: 2 rows (3, 33). "
                                     f"The first: {second} row 3: key 'prompt' must be a non-empty list")
    capsys.readouterr()
    check_reward_data([str(first), str(second)], judge_configured=False, on_bad_row="skip")
    assert capsys.readouterr().out == (f"data: 2 of 60 rows fail the row check and will be skipped "
                                       f"(data.on_bad_row=skip): {second}: 2 rows (3, 33)\n")


def test_unknown_data_source_names_its_first_row_and_count(tmp_path):
    rows = _rows(10)
    for index in (4, 6, 9):
        rows[index]["data_source"] = "my_new_task"
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(UserError, match=rf"^{path} row 4 \(the first of 3 rows with data_source 'my_new_task'\): "
                                        r"no reward function for data_source 'my_new_task'"):
        check_reward_data(str(path), judge_configured=False)


# ----- arguments: convert layouts, ports, keys --------------------------------------------------------------------


def test_convert_layout_is_checked_against_config_json(tmp_path, capsys):
    model = _model(tmp_path / "m")
    check_layout(model / "config.json", 4, 3)
    with pytest.raises(UserError, match=r"^--tp 0: must be >= 1$"):
        check_layout(model / "config.json", 0, 1)
    with pytest.raises(UserError) as err:
        check_layout(model / "config.json", 3, 1)
    assert str(err.value) == (f"--tp 3 does not divide the model's 4 key/value heads (num_key_value_heads in "
                              f"{model / 'config.json'}); --tp can be 1, 2, 4")
    with pytest.raises(UserError, match=r"^--pp 4 does not divide the model's 6 layers"):
        check_layout(model / "config.json", 1, 4)
    out = tmp_path / "out"
    assert main(["convert", "hf-to-megatron", "--hf", str(model), "--out", str(out), "--tp", "3"]) == 2
    assert capsys.readouterr().err.startswith("rl360: error: --tp 3 does not divide the model's 4 key/value heads")
    assert not out.exists()  # no rank started


@pytest.mark.parametrize("service", ["sandbox", "model", "rollout", "listener"])
def test_port_out_of_range_is_refused(service, capsys):
    with pytest.raises(SystemExit) as code:
        main(["serve", service, "--model", "m", "--port", "99999"] if service != "sandbox" else
             ["serve", service, "--port", "99999"])
    assert code.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"rl360 serve {service}: error: argument --port: must be 0..65535 (0: any free port), got 99999")


@pytest.mark.parametrize("service, exposure", [
    ("model", "anyone who reaches it can use the model"),
    ("rollout", "anyone who reaches it can generate and replace the weights"),
    ("listener", "anyone who reaches it can have it read image files"),
])
def test_model_and_rollout_refuse_a_network_host_without_a_key(service, exposure, tmp_path, capsys):
    model = _model(tmp_path / "m")
    assert main(["serve", service, "--model", str(model), "--host", "0.0.0.0", "--port", "0"]) == 2
    assert capsys.readouterr().err == (
        f"rl360: error: serve {service}: refusing to listen on 0.0.0.0 without a key: {exposure}. Pass --api-key-env "
        "VAR (clients send 'Authorization: Bearer <key>'), or listen on 127.0.0.1 and tunnel to it.\n")
    assert main(["serve", service, "--model", str(tmp_path / "none"), "--port", "0"]) == 2
    assert f"--model={tmp_path / 'none'}: no such directory" in capsys.readouterr().err
