import re

import pytest

from rl360.config import ConfigError, load_config

BASE = ["model.path=m", "data.train_files=[d.parquet]"]


def test_quickstart_yaml_loads_with_overrides():
    cfg = load_config("configs/quickstart.yaml", ["trainer.total_steps=3", "actor.lr=1e-3"])
    assert cfg.trainer.total_steps == 3
    assert cfg.actor.lr == pytest.approx(1e-3)
    assert cfg.rollout.n == 16
    assert isinstance(cfg.actor.betas, tuple)


def test_unknown_key_names_the_key_and_its_close_matches():
    with pytest.raises(ConfigError) as err:
        load_config(None, BASE + ["actor.lrr=1"])
    assert str(err.value) == "override 'actor.lrr=1': unknown config key 'actor.lrr'; close matches: actor.lr"
    # the same name in other sections
    with pytest.raises(ConfigError, match=r"'data\.n'; close matches: rollout\.n, validation\.n$"):
        load_config(None, BASE + ["data.n=4"])
    with pytest.raises(ConfigError, match=r"'actor\.zzzzzz'; no close match"):
        load_config(None, BASE + ["actor.zzzzzz=1"])


def test_unknown_nested_key_in_yaml_names_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("actor:\n  parallel:\n    tensr: 2\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: unknown config key 'actor\.parallel\.tensr'; close "
                                          r"matches: actor\.parallel\.tensor$"):
        load_config(path)


def test_bad_choice_names_allowed_values():
    with pytest.raises(ConfigError, match=r"algorithm\.adv_estimator='foo'.*\[.*'grpo', .*'rloo'.*\]"):
        load_config(None, BASE + ["algorithm.adv_estimator=foo"])


def test_bad_type_names_the_key():
    with pytest.raises(ConfigError, match=r"actor\.lr"):
        load_config(None, BASE + ["actor.lr=fast"])


def test_ranges_and_relations_are_checked():
    with pytest.raises(ConfigError, match=r"rollout\.n=0 must be > 0"):
        load_config(None, BASE + ["rollout.n=0"])
    with pytest.raises(ConfigError, match=r"data\.batch_size=10 must be a multiple of actor\.ppo_mini_batch_size=4"):
        load_config(None, BASE + ["data.batch_size=10", "actor.ppo_mini_batch_size=4"])
    with pytest.raises(ConfigError, match=r"model\.path is empty"):
        load_config(None, ["data.train_files=[d.parquet]"])


def test_several_engines_need_engine_processes():
    with pytest.raises(ConfigError, match=r"rollout\.num_engines=2 needs rollout\.engine=server or sglang"):
        load_config(None, BASE + ["rollout.num_engines=2"])
    cfg = load_config(None, BASE + ["rollout.num_engines=2", "rollout.engine=server", "rollout.mode=async"])
    assert (cfg.rollout.num_engines, cfg.rollout.weight_sync, cfg.rollout.mode) == (2, "distributed", "async")
    with pytest.raises(ConfigError, match=r"rollout\.weight_sync"):
        load_config(None, BASE + ["rollout.weight_sync=nccl"])


def test_override_without_equals_sign():
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, BASE + ["actor.lr"])


def test_missing_file():
    with pytest.raises(ConfigError, match="config file not found"):
        load_config("nope.yaml")


def test_algorithm_presets_layer_over_a_base_config():
    cfg = load_config("configs/quickstart.yaml", ["configs/algorithms/gspo.yaml", "actor.clip_ratio_high=5e-4"])
    assert cfg.actor.loss_mode == "gspo" and cfg.actor.clip_ratio_low == pytest.approx(3e-4)
    assert cfg.actor.clip_ratio_high == pytest.approx(5e-4)  # later overrides win
    assert cfg.rollout.n == 16  # the base config's keys stay
    for preset in ("grpo", "drgrpo"):
        load_config("configs/quickstart.yaml", [f"configs/algorithms/{preset}.yaml"])
    with pytest.raises(ConfigError, match="config file not found"):
        load_config("configs/quickstart.yaml", ["configs/algorithms/nope.yaml"])


def test_a_mapping_on_the_command_line_replaces_the_one_before_and_a_file_merges_into_it(tmp_path, monkeypatch):
    monkeypatch.setenv("RL360_MODEL_PATH", "m")
    monkeypatch.setenv("RL360_DATA_DIR", "d")
    template = "configs/templates/qwen2.5-7b-1node.yaml"  # data.mix_weights: six data_source prefixes
    assert load_config(template, ["data.mix_weights={}"]).data.mix_weights == {}
    assert load_config(template, ["+data.mix_weights={math: 1.0}"]).data.mix_weights == {"math": 1.0}
    assert len(load_config(template, ["data.mix_weights.math=1.0"]).data.mix_weights) == 6  # one key of it
    (tmp_path / "preset.yaml").write_text("data:\n  mix_weights: {math: 1.0}\n")
    merged = load_config(template, [str(tmp_path / "preset.yaml")]).data.mix_weights
    assert merged["math"] == 1.0 and merged["codegen"] == 0.25  # a YAML layer merges, as Hydra composes files
    assert load_config(template, ["data.mix_weights={}", str(tmp_path / "preset.yaml")]).data.mix_weights == {
        "math": 1.0}


def test_estimators_and_losses_by_name_or_importable_reference():
    base = ["model.path=m", "data.train_files=[x.parquet]"]
    cfg = load_config(None, [*base, "algorithm.adv_estimator=tests.algo_fixtures:unit_advantages",
                             "actor.loss_mode=tests.algo_fixtures:constant_loss"])
    assert cfg.algorithm.adv_estimator == "tests.algo_fixtures:unit_advantages"
    with pytest.raises(ConfigError, match=r"actor.loss_mode='ppo'.*unknown policy loss 'ppo'; choose one of .*gspo"):
        load_config(None, [*base, "actor.loss_mode=ppo"])
    with pytest.raises(ConfigError, match="algorithm.adv_estimator='tests.algo_fixtures:nope'.*has no 'nope'"):
        load_config(None, [*base, "algorithm.adv_estimator=tests.algo_fixtures:nope"])
    with pytest.raises(ConfigError, match="actor.loss_mode='no_such_pkg:fn'.*cannot import 'no_such_pkg'"):
        load_config(None, [*base, "actor.loss_mode=no_such_pkg:fn"])


def test_clip_range_defaults_follow_the_loss_unless_set():
    import torch

    from rl360.algos.losses import get_policy_loss

    actor = load_config(None, ["model.path=m", "data.train_files=[x.parquet]"]).actor
    assert actor.clip_ratio_low is None and actor.clip_ratio_high is None
    logprob, old, advantages, mask = torch.full((1, 4), 1e-3), torch.zeros(1, 4), torch.ones(1, 4), torch.ones(1, 4)

    def clipped(loss_mode):  # a ratio of exp(1e-3): outside gspo's 1 + 4e-4, inside PPO's 1 + 0.2
        return bool(get_policy_loss(loss_mode)(logprob, old, advantages, mask, actor)[1].all())

    assert clipped("gspo") and clipped("gspo_token") and not clipped("vanilla")
    actor.clip_ratio_high = 0.28  # set: every loss takes it
    assert not clipped("gspo")


def test_expert_parallel_size_must_divide_data_times_context():
    base = ["model.path=/m", "data.train_files=[x.parquet]", "actor.ppo_mini_batch_size=4", "data.batch_size=4"]
    cfg = load_config(None, [*base, "actor.parallel.data=2", "actor.parallel.context=2", "actor.parallel.expert=4"])
    assert cfg.actor.parallel.expert == 4 and cfg.actor.parallel.ranks == 4  # EP takes no ranks of its own
    with pytest.raises(ConfigError, match=r"actor\.parallel\.expert=4 must divide .* = 2"):
        load_config(None, [*base, "actor.parallel.data=2", "actor.parallel.expert=4"])
    with pytest.raises(ConfigError, match=r"actor\.parallel\.expert=0 must be > 0"):
        load_config(None, [*base, "actor.parallel.expert=0"])
    with pytest.raises(ConfigError, match=r"actor\.moe_aux_loss_coef=-0\.1 must be >= 0"):
        load_config(None, [*base, "actor.moe_aux_loss_coef=-0.1"])


@pytest.mark.parametrize("override, key, value", [
    ("data.train_batch_size=32", "data.batch_size", 32),
    ("actor_rollout_ref.actor.optim.lr=1e-6", "actor.lr", 1e-6),
    ("actor_rollout_ref.rollout.n=4", "rollout.n", 4),
    ("actor_rollout_ref.model.path=m2", "model.path", "m2"),
    ("+trainer.total_training_steps=5", "trainer.total_steps", 5),
    ("data.max_response_length=64", "rollout.max_response_length", 64),
    ("trainer.test_freq=5", "validation.every", 5),
    ("actor_rollout_ref.rollout.val_kwargs.n=4", "validation.n", 4),
])
def test_verl_keys_are_read_as_the_rl360_key_and_said(override, key, value, capsys):
    cfg = load_config(None, BASE + ["data.val_files=[v.parquet]", override])
    section, leaf = key.rsplit(".", 1)
    target = cfg
    for part in section.split("."):
        target = getattr(target, part)
    assert getattr(target, leaf) == value
    verl_key = override.lstrip("+").split("=")[0]
    assert f"verl's {verl_key} read as {key}" in capsys.readouterr().err


@pytest.mark.parametrize("override, message", [
    ("trainer.total_epochs=3", "'trainer.total_epochs' (verl's): rl360 counts steps, not epochs: set "
                               "trainer.total_steps"),
    ("actor_rollout_ref.actor.use_kl_loss=true", "did you mean rl360's algorithm.kl_coef (> 0 adds the KL loss)?"),
    ("data.prompt_key=question", "(verl's): rl360 reads the 'prompt' column of the verl schema"),
])
def test_verl_keys_without_an_rl360_twin_are_refused_saying_why(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, BASE + [override])
    assert message in str(err.value)


def test_verl_section_in_yaml_is_read_key_by_key(tmp_path, capsys):
    path = tmp_path / "verl.yaml"
    path.write_text("actor_rollout_ref:\n  actor:\n    optim:\n      lr: 1.0e-6\n    ppo_epochs: 2\n")
    cfg = load_config(path, BASE)
    assert (cfg.actor.lr, cfg.actor.ppo_epochs) == (1e-6, 2)
    assert "verl.yaml: verl's actor_rollout_ref.actor.optim.lr read as actor.lr" in capsys.readouterr().err
    path.write_text("actor_rollout_ref:\n  actor:\n    optim:\n      lr: 1.0e-6\n      betas: [0.9, 0.99]\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'actor_rollout_ref\.actor\.optim\.betas'"):
        load_config(path, BASE)
    path.write_text("actor:\n  lr: 2.0e-6\nactor_rollout_ref:\n  actor:\n    optim:\n      lr: 1.0e-6\n")
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.actor\.optim\.lr \(verl's name for actor\.lr\) "
                                          r"and actor\.lr are both set"):
        load_config(path, BASE)


def test_hydra_add_prefix_and_single_string_lists():
    cfg = load_config(None, ["+model.path=m", "++trainer.total_steps=3", "data.train_files=one.parquet",
                             "rollout.engine_args=--flag"])
    assert (cfg.model.path, cfg.trainer.total_steps) == ("m", 3)
    assert cfg.data.train_files == ["one.parquet"] and cfg.rollout.engine_args == ["--flag"]
    with pytest.raises(ConfigError, match=r"Hydra's ~key \(delete a key\) does not apply"):
        load_config(None, BASE + ["~trainer.total_steps"])
    with pytest.raises(ConfigError, match=r"unknown config key 'trainer\.nope'"):  # + does not invent keys
        load_config(None, BASE + ["+trainer.nope=1"])


def test_single_string_list_in_yaml(tmp_path):
    path = tmp_path / "one.yaml"
    path.write_text("model:\n  path: m\ndata:\n  train_files: one.parquet\n")
    assert load_config(path).data.train_files == ["one.parquet"]


def test_yaml_syntax_error_is_file_line_column(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("model:\n  path: m\n  dtype: float32: x\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"{path}:3:17: mapping values are not allowed in this context"
    preset = tmp_path / "preset.yaml"
    preset.write_text("actor:\n\tlr: 1\n")
    with pytest.raises(ConfigError) as err:
        load_config(None, BASE + [str(preset)])
    assert str(err.value) == (f"{preset}:2:1: found character that cannot start any token (while scanning for the "
                              "next token)")
    with pytest.raises(ConfigError, match=r"^override 'data\.batch_size=\[1,': not valid YAML: "):
        load_config(None, BASE + ["data.batch_size=[1,"])


def test_missing_environment_variable_names_key_and_variable(monkeypatch):
    monkeypatch.delenv("RL360_MODEL_PATH", raising=False)
    monkeypatch.setenv("RL360_DATA_DIR", "data")
    with pytest.raises(ConfigError, match=r"^configs/templates/qwen2\.5-7b-1node\.yaml: model\.path reads "
                                          r"environment variable RL360_MODEL_PATH, which is not set: export "
                                          r"RL360_MODEL_PATH=\.\.\. or pass model\.path=\.\.\. on the command line$"):
        load_config("configs/templates/qwen2.5-7b-1node.yaml")
    monkeypatch.delenv("RL360_DATA_DIR")  # every unset one in the same line
    with pytest.raises(ConfigError, match=r"^configs/templates/qwen2\.5-7b-1node\.yaml: environment variables not "
                                          r"set: model\.path reads RL360_MODEL_PATH, data\.train_files reads "
                                          r"RL360_DATA_DIR: export RL360_MODEL_PATH=\.\.\. RL360_DATA_DIR=\.\.\. "
                                          r"or pass model\.path=\.\.\. data\.train_files=\.\.\. on the command line$"):
        load_config("configs/templates/qwen2.5-7b-1node.yaml")


def test_evaluation_during_training_needs_held_out_files_and_ks_within_n():
    with pytest.raises(ConfigError, match=r"^validation\.every evaluates held-out prompts: give them in "
                                          r"data\.val_files "):
        load_config(None, BASE + ["validation.every=5"])
    with pytest.raises(ConfigError, match=r"^validation\.before_train evaluates held-out prompts"):
        load_config(None, BASE + ["validation.before_train=true"])
    with pytest.raises(ConfigError, match=r"^validation\.pass_k has 4: each k must be in \[1, validation\.n=2\]$"):
        load_config(None, BASE + ["data.val_files=[v.parquet]", "validation.n=2", "validation.pass_k=[1,4]"])
    with pytest.raises(ConfigError, match=r"^validation\.every=-1 must be >= 0$"):
        load_config(None, BASE + ["data.val_files=[v.parquet]", "validation.every=-1"])
    cfg = load_config(None, BASE + ["data.val_files=v.parquet", "validation.every=5"])
    assert cfg.data.val_files == ["v.parquet"] and cfg.validation.n == 1 and cfg.validation.temperature == 0.0


@pytest.mark.parametrize("old, new", [("trainer.eval_every=5", "validation.every"),
                                      ("trainer.eval_before_train=true", "validation.before_train"),
                                      ("trainer.eval_at_end=true", "validation.at_end"),
                                      ("eval.n=2", "validation.n"), ("eval.temperature=0.5", "validation.temperature"),
                                      ("eval.top_p=0.9", "validation.top_p"), ("eval.top_k=5", "validation.top_k"),
                                      ("eval.max_response_length=8", "validation.max_response_length"),
                                      ("eval.pass_k=[1]", "validation.pass_k")])
def test_renamed_held_out_keys_are_refused_naming_the_new_key(old, new, tmp_path):
    key = old.split("=")[0]
    message = rf"config key '{re.escape(key)}' was renamed to {re.escape(new)}: set {re.escape(new)} "
    with pytest.raises(ConfigError, match=message):
        load_config(None, BASE + ["data.val_files=[v.parquet]", old])
    section, leaf = key.split(".")
    value = old.split("=")[1]
    path = tmp_path / "old.yaml"
    path.write_text(f"{section}:\n  {leaf}: {value}\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: {message}"):
        load_config(path, BASE + ["data.val_files=[v.parquet]"])


def _endings_given(path) -> set[str]:
    """The strings a module assigns to `ended_by` (dict keys left out: `{"stop": "done"}.get(...)` gives "done")."""
    import ast

    keys, given = set(), set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) and node.value is not None else []
        if any(isinstance(target, ast.Name) and target.id == "ended_by" for target in targets):
            for part in ast.walk(node.value):
                if isinstance(part, ast.Dict):
                    keys |= {id(key) for key in part.keys}
                elif isinstance(part, ast.Constant) and isinstance(part.value, str) and id(part) not in keys:
                    given.add(part.value)
    return given


def test_every_trajectory_ending_can_be_kept_by_partial_filtering():
    """One list of endings: every one the agent loop gives is one partial_filter_keep may name, and config
    validation accepts each of them."""
    from pathlib import Path

    from rl360.core import TRAJECTORY_ENDINGS

    loop = Path(__file__).resolve().parents[1] / "rl360" / "agents" / "loop.py"
    given = _endings_given(loop)
    assert {"done", "max_turns", "budget", "image_token"} <= given  # the check reads the loop's endings
    assert given <= set(TRAJECTORY_ENDINGS)
    cfg = load_config(None, BASE + [f"algorithm.partial_filter_keep=[{','.join(TRAJECTORY_ENDINGS)}]"])
    assert cfg.algorithm.partial_filter_keep == list(TRAJECTORY_ENDINGS)
    with pytest.raises(ConfigError, match=r"partial_filter_keep has \['finished'\].*'image_token'"):
        load_config(None, BASE + ["algorithm.partial_filter_keep=[done,finished]"])


def test_engine_checks_ask_the_engine_kinds_table(monkeypatch):
    """The config's engine checks read each kind's capabilities (rl360.core.engine_kinds), not its name."""
    import dataclasses

    from rl360.core import engine_kinds

    server = ["rollout.engine=server", "rollout.num_engines=2", "rollout.mode=async"]
    assert load_config(None, BASE + server).rollout.num_engines == 2
    pixels = ["rollout.engine=sglang", "model.min_pixels=1024"]
    with pytest.raises(ConfigError, match="SGLang engines take an image's pixel bounds from the model's preprocessor"):
        load_config(None, BASE + pixels)
    kinds = dict(engine_kinds.ENGINE_KINDS)
    kinds["server"] = dataclasses.replace(kinds["server"], in_process=True)
    kinds["sglang"] = dataclasses.replace(kinds["sglang"], pixel_flags=True)
    monkeypatch.setattr(engine_kinds, "ENGINE_KINDS", kinds)
    with pytest.raises(ConfigError, match=r"rollout\.num_engines=2 needs rollout\.engine=sglang \(rollout\.engine="
                                          r"server is one in-process engine\)"):
        load_config(None, BASE + server)
    assert load_config(None, BASE + pixels).model.min_pixels == 1024


def test_weight_sync_is_checked_against_the_engines_it_reaches():
    with pytest.raises(ConfigError, match=r"rollout\.weight_sync=tensor sends rl360's own formats .* with "
                                          r"rollout\.engine=sglang use rollout\.weight_sync=disk or distributed"):
        load_config(None, BASE + ["rollout.engine=sglang", "rollout.weight_sync=tensor"])
    with pytest.raises(ConfigError, match=r"engine_hosts=ray needs .* rollout\.weight_sync=disk or distributed "
                                          r"\(tensor sync and colocation need the engines on the trainer's node"):
        load_config(None, BASE + ["rollout.engine=server", "rollout.weight_sync=tensor", "rollout.engine_hosts=ray"])
    assert load_config(None, BASE + ["rollout.weight_sync=tensor"]).rollout.weight_sync == "tensor"  # hf: unused
