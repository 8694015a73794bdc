"""`rl360 plan`: parameter counts against megatron's own tensors and published model sizes, the optimizer term
against the state megatron's mixed-precision Adam allocates, and the fit verdict of the command."""

import json
from pathlib import Path

import pytest
import torch

from rl360.actor.policy import PolicyWorker
from rl360.actor.settings import PolicySettings
from rl360.cli import main
from rl360.config import load_config
from rl360.model_shapes import released_config, released_name
from rl360.plan import GIB, RESERVED_GIB, plan, rank_parameters
from tests.helpers import make_tiny_model

QWEN2 = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"])
FIXTURES = Path(__file__).parent / "fixtures" / "configs"


@pytest.mark.parametrize("shape, published", [  # parameter counts of the released checkpoints
    (dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
          num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True), 1_543_714_304),  # Qwen2.5-1.5B
    (dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
          num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False), 7_615_616_512),  # Qwen2.5-7B
    (dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
          num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False), 32_763_876_352),  # Qwen2.5-32B
])
def test_parameter_count_of_released_models(shape, published):
    assert rank_parameters({**QWEN2, **shape}) == published


def test_parameter_count_of_qwen2_5_vl_7b_counts_its_vision_tower_on_the_first_stage():
    """Qwen2.5-VL-7B-Instruct's config.json (flat, as released): 8,292,166,656 parameters published."""
    hf = json.loads((FIXTURES / "qwen2.5-vl-7b.json").read_text())
    assert rank_parameters(hf) == 8_292_166_656
    first, last = rank_parameters(hf, pipeline=2, stage=0), rank_parameters(hf, pipeline=2, stage=1)
    assert first - last == 676_550_144 - 3584  # the same layers; the tower and embedding vs the final norm and head


def test_parameter_count_of_qwen3_30b_a3b_and_its_expert_parallel_share():
    """Qwen3-30B-A3B's config.json as released: 30,532,122,624 parameters on its model card; at EP=8 a rank holds
    16 of each layer's 128 experts and everything else whole."""
    hf = json.loads((FIXTURES / "qwen3-30b-a3b.json").read_text())
    assert rank_parameters(hf) == 30_532_122_624
    experts = 48 * 128 * 3 * 768 * 2048  # layers x experts x (gate, up, down) x moe_intermediate_size x hidden
    assert rank_parameters(hf, expert=8) == 30_532_122_624 - experts + experts // 8
    assert rank_parameters(hf, tensor=2, expert=8) == rank_parameters(hf, expert=8) - (
        # halved: attention and output projections, experts, embedding, output layer; whole: norms, router
        48 * ((32 + 8) * 128 * 2048 + 2048 * 32 * 128 + 16 * 3 * 768 * 2048) + 2 * 151936 * 2048) // 2


@pytest.mark.parametrize("preset", ["", "8gpu", "16gpu", "32gpu", "64gpu"])
def test_deepvision_recipe_and_presets_fit_on_80_gb(tmp_path, monkeypatch, preset):
    (tmp_path / "config.json").write_text((FIXTURES / "qwen2.5-vl-7b.json").read_text())
    monkeypatch.setenv("RL360_MODEL_PATH", str(tmp_path))
    monkeypatch.setenv("RL360_DATA_DIR", str(tmp_path))
    presets = [f"configs/recipes/deepvision/{preset}.yaml"] if preset else []
    cfg = load_config("configs/recipes/deepvision.yaml", presets)
    assert cfg.actor.loss_mode == "gspo" and cfg.rollout.n == 16 and cfg.algorithm.filter_groups
    result = plan(cfg, gpu_memory_gb=80)
    assert result.fits(), result.problem()


def _config(model_dir, *overrides):
    return load_config(None, [f"model.path={model_dir}", "data.train_files=[unused.parquet]", "rollout.n=2",
                              "data.batch_size=2", "actor.ppo_mini_batch_size=2", "algorithm.kl_coef=0",
                              *overrides])


@pytest.mark.parametrize("arch, tied", [("qwen2", True), ("qwen3", False), ("llama", False), ("qwen3_moe", False),
                                        ("qwen2_moe", True)])
def test_weights_gradients_and_optimizer_terms_are_what_megatron_allocates(megatron_single_rank, tmp_path,
                                                                            arch, tied):
    model_dir = make_tiny_model(str(tmp_path / arch), arch, tie_word_embeddings=tied)
    cfg = _config(model_dir, "model.dtype=bfloat16")
    worker = PolicyWorker(PolicySettings.of(cfg))
    params = list(worker.models[0].parameters())
    count = sum(p.numel() for p in params)
    hf = json.loads((tmp_path / arch / "config.json").read_text())
    assert rank_parameters(hf) == count
    terms = {term.name: term.bytes for term in plan(cfg).terms}
    assert terms["policy weights"] == sum(p.numel() * p.element_size() for p in params)
    grad_buffer = sum(buffer.grad_data.numel() * buffer.grad_data.element_size()
                      for buffer in worker.models[0].buffers + worker.models[0].expert_parallel_buffers)
    assert terms["policy gradients (fp32 buffer)"] <= grad_buffer <= terms["policy gradients (fp32 buffer)"] * 1.01
    for param in params:  # one optimizer step allocates Adam's moments
        param.main_grad.normal_()
    worker.optimizer.step()
    state = 0
    for inner in worker.optimizer.chained_optimizers:
        for group in inner.fp32_from_float16_groups:
            for main_param in group:
                state += main_param.numel() * 4 + sum(t.numel() * t.element_size()
                                                      for t in inner.optimizer.state[main_param].values()
                                                      if torch.is_tensor(t) and t.dim() > 0)
    assert terms["policy optimizer (Adam + fp32 main weights)"] == state


def test_plan_command_says_whether_a_layout_fits(tmp_path, capsys):
    model = tmp_path / "qwen2.5-32b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        **QWEN2, "hidden_size": 5120, "intermediate_size": 27648, "num_hidden_layers": 64,
        "num_attention_heads": 40, "num_key_value_heads": 8, "vocab_size": 152064, "tie_word_embeddings": False}))
    common = ["configs/quickstart.yaml", f"model.path={model}", "model.dtype=bfloat16", "data.max_prompt_length=1024",
              "rollout.max_response_length=8192", "actor.ppo_mini_batch_size=16", "data.batch_size=32"]
    code = main(["plan", *common, "actor.parallel.tensor=8", "actor.parallel.pipeline=4", "actor.parallel.data=1",
                 "actor.max_tokens_per_micro_batch=16384", "actor.pack_sequences=true", "actor.recompute=full"])
    out = capsys.readouterr().out
    assert code == 0 and out.strip().endswith("fits"), out
    assert "TP 8 x PP 4 x DP 1 = 32 GPU(s) (4 node(s) of 8)" in out
    code = main(["plan", *common, "actor.micro_batch_size=1", "actor.recompute=full"])  # one GPU for 32B
    out = capsys.readouterr().out
    assert code == 1 and "does not fit: the train phase needs" in out
    assert "the largest term is policy optimizer (Adam + fp32 main weights) (366.2 GiB)" in out, out


def test_colocated_engines_count_while_generating(tmp_path):
    model_dir = make_tiny_model(str(tmp_path / "m"), "qwen2", tie_word_embeddings=True)
    cfg = _config(model_dir, "rollout.engine=server", "rollout.colocate=true", "rollout.mem_fraction=0.5")
    result = plan(cfg, gpu_memory_gb=80)
    assert result.total("rollout") - result.total("train") == pytest.approx(
        40 * GIB - dict((t.name, t.bytes) for t in result.terms)["activations (recompute=none)"])


def test_a_model_path_without_config_json_is_named(tmp_path, capsys):
    code = main(["plan", "configs/quickstart.yaml", f"model.path={tmp_path}"])
    assert code == 2 and f"model.path={tmp_path}: no config.json there to plan from" in capsys.readouterr().err


def test_offload_counts_optimizer_gradients_and_reference_only_while_training(tmp_path):
    model_dir = make_tiny_model(str(tmp_path / "m"), "qwen2", tie_word_embeddings=True)
    common = ["rollout.engine=server", "rollout.colocate=true", "algorithm.kl_coef=0.01"]
    resident = plan(_config(model_dir, *common))
    offloaded = plan(_config(model_dir, *common, "actor.offload=true"))
    assert all(term.phase == "all" for term in resident.terms if not term.name.startswith(("activations", "colocated")))
    phases = {t.name: t.phases for t in offloaded.terms}
    assert phases["policy weights"] == phases["policy gradients (fp32 buffer)"] == ("train", "step")
    assert phases["reference model weights"] == ("train",) and phases["policy optimizer (Adam)"] == ("step",)
    # while colocated engines generate, only their share and the reserve are on the GPU
    engine = next(t.bytes for t in offloaded.terms if t.name.startswith("colocated engine"))
    assert offloaded.total("rollout") == pytest.approx(engine + RESERVED_GIB * GIB)
    # the passes run without the optimizer state, the steps without the activations and the reference
    sizes = {t.name: t.bytes for t in offloaded.terms}
    activations = sizes["activations (recompute=none)"]
    assert offloaded.total("train") == pytest.approx(resident.total("train") - sizes["policy optimizer (Adam)"])
    assert offloaded.total("step") == pytest.approx(resident.total("train") - activations
                                                    - sizes["reference model weights"])


def test_virtual_pipeline_stages_keep_more_activations_on_the_first_stage(tmp_path):
    """PP=4 x VPP=2 with 8 micro-batches: the first stage runs 2 x 3 + 1 x 4 warm-up chunk passes and holds one
    more, 11 passes over 1 layer each, against 1F1B's 4 micro-batches over 2 layers (the logits term as it was)."""
    from megatron_bridge.config_map import padded_vocab_size

    model_dir = make_tiny_model(str(tmp_path / "m"), "qwen2", tie_word_embeddings=True, num_layers=8)
    common = ["actor.parallel.pipeline=4", "actor.micro_batch_size=2", "actor.ppo_mini_batch_size=4", "rollout.n=4",
              "data.batch_size=4"]

    def activations(*extra):
        cfg = _config(model_dir, *common, *extra)
        tokens = 2 * (cfg.data.max_prompt_length + cfg.rollout.max_response_length)
        logits = tokens * padded_vocab_size(99) * (4 + 4)  # fp32 logits and their fp32 softmax
        return next(t.bytes for t in plan(cfg).terms if t.name.startswith("activations")) - logits

    assert activations("actor.parallel.virtual_pipeline=2") == pytest.approx(activations() * 11 / 8)


# ----- every shipped config plans, or says in one line what it needs --------------------------------------------

REPO = Path(__file__).resolve().parents[1]
SHIPPED = sorted(str(p.relative_to(REPO)) for p in (REPO / "configs").rglob("*.yaml"))
TEMPLATE_MODELS = {"qwen2.5-7b": "Qwen/Qwen2.5-7B-Instruct", "qwen2.5-32b": "Qwen/Qwen2.5-32B-Instruct",
                   "deepvision": "Qwen/Qwen2.5-VL-7B-Instruct", "deepeyes": "Qwen/Qwen2.5-VL-7B-Instruct",
                   "pyvision": "Qwen/Qwen2.5-VL-7B-Instruct", "lewis": "Qwen/Qwen2.5-VL-7B-Instruct"}


@pytest.mark.parametrize("config", SHIPPED)
def test_plan_answers_on_every_shipped_config(config, tmp_path, monkeypatch, capsys):
    for name in ("RL360_MODEL_PATH", "RL360_DATA_DIR", "RL360_OUTPUT_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)  # the quickstart's relative model directories are not built here
    code = main(["plan", str(REPO / config)])
    captured = capsys.readouterr()
    if code in (0, 1):
        assert captured.out.strip().endswith(("fits", "does not fit")) or "does not fit" in captured.out, captured.out
        return
    assert code == 2, (code, captured)
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    line = lines[0]
    if "oc.env" in (REPO / config).read_text():  # a template: names every variable it needs
        assert "environment variables not set: model.path reads RL360_MODEL_PATH" in line, line
        assert "RL360_DATA_DIR" in line, line
    elif config.startswith("configs/eval/"):  # an `rl360 eval` config: says so
        assert "is an `rl360 eval` config" in line and "rl360 plan plans training runs" in line, line
    elif "outputs/quickstart_assets/" in (REPO / config).read_text():  # its model is built by `rl360 quickstart`
        assert "no such directory to plan from (rl360 quickstart builds it)" in line, line
    else:  # a preset: says so
        assert "model.path is empty" in line and "preset, to follow a base config" in line, line


@pytest.mark.parametrize("config", [c for c in SHIPPED if "oc.env" in (REPO / c).read_text()])
def test_templates_plan_from_a_released_models_name_without_a_checkpoint(config, tmp_path, monkeypatch, capsys):
    model = next(hub for key, hub in TEMPLATE_MODELS.items() if key in config)
    monkeypatch.setenv("RL360_MODEL_PATH", model)
    monkeypatch.setenv("RL360_DATA_DIR", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    code = main(["plan", str(REPO / config)])
    out = capsys.readouterr().out
    assert code == 0 and out.strip().endswith("fits"), out  # the shipped layouts fit an 80 GB GPU
    assert f"no local checkpoint at {model}: planned with the released {model.split('/')[1][:-len('-Instruct')]}'s" \
           in out, out


@pytest.mark.parametrize("name, published", [  # parameter counts on the model cards / the released safetensors
    ("Qwen2.5-0.5B", 494_032_768), ("Qwen2.5-1.5B-Instruct", 1_543_714_304), ("Qwen2.5-3B", 3_085_938_688),
    ("Qwen/Qwen2.5-7B-Instruct", 7_615_616_512), ("Qwen2.5-14B", 14_770_033_664),
    ("Qwen2.5-32B", 32_763_876_352), ("Qwen2.5-72B-Instruct", 72_706_203_648),
    ("Qwen/Qwen2.5-VL-7B-Instruct", 8_292_166_656), ("Qwen3-30B-A3B", 30_532_122_624),
    ("meta-llama/Llama-3.1-8B-Instruct", 8_030_261_248), ("meta-llama/Meta-Llama-3-8B", 8_030_261_248),
    ("Llama-3.1-70B", 70_553_706_496), ("meta-llama/Llama-3.2-1B-Instruct", 1_235_814_400),
    ("Llama-3.2-3B", 3_212_749_824), ("meta-llama/Llama-3.3-70B-Instruct", 70_553_706_496),
])
def test_released_shapes_by_name_count_the_published_parameters(name, published):
    assert rank_parameters(released_config(name)) == published


@pytest.mark.parametrize("name, billions, unit", [  # as rounded on the model cards (to `unit` billion)
    ("Qwen3-0.6B", 0.6, 0.1), ("Qwen3-1.7B", 1.7, 0.1), ("Qwen3-4B", 4.0, 0.1), ("Qwen3-8B", 8.2, 0.1),
    ("Qwen3-14B", 14.8, 0.1), ("Qwen3-32B", 32.8, 0.1), ("Qwen3-235B-A22B", 235, 1),
    ("Qwen2.5-VL-3B-Instruct", 3.75, 0.01), ("Qwen2.5-VL-72B", 73.4, 0.1),
])
def test_released_shapes_by_name_round_to_the_model_cards(name, billions, unit):
    assert rank_parameters(released_config(name)) / 1e9 == pytest.approx(billions, abs=unit / 2)


def test_released_names_match_whole_name_parts_only():
    assert released_name("/ckpt/Qwen2.5-7B") == "Qwen2.5-7B"
    assert released_name("qwen3-30b-a3b-base") == "Qwen3-30B-A3B"
    assert released_name("Qwen/Qwen2.5-VL-72B-Instruct") == "Qwen2.5-VL-72B"
    assert all(released_name(name) is None for name in ("Qwen2.5-7Bx", "my-model", "Qwen3-1", "Qwen2.5-7"))
    assert released_name("Qwen/Qwen3-30B-A3B-Thinking-2507") == "Qwen3-30B-A3B"
    assert released_name("Qwen/Qwen2.5-7B-Instrct") is None  # a typo is not a variant
    assert released_name("Qwen/Qwen2.5-Math-7B") is None  # another model, not a variant


def test_a_misspelt_released_name_is_refused_with_the_close_ones(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RL360_MODEL_PATH", "Qwen/Qwen2.5-7B-Instrct")
    monkeypatch.setenv("RL360_DATA_DIR", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert main(["plan", str(REPO / "configs/templates/qwen2.5-7b-1node.yaml")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "rl360: config error: model.path=Qwen/Qwen2.5-7B-Instrct: no such directory, and not a released model's "
        "name rl360 knows; did you mean Qwen2.5-7B-Instruct or Qwen2.5-72B-Instruct or Qwen2.5-3B-Instruct?")
