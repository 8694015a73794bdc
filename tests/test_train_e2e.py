"""A short whole run on a local Ray cluster: real Megatron actor, HF engine, reward pool, parquet data."""

import json
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rl360.config import load_config
from rl360.quickstart.assets import build_quickstart_model
from rl360.trainer import train
from tests.algo_fixtures import CONSTANT_LOSS
from tests.test_trackers import _swanlab, _tensorboard

# whole training runs (`pytest -m "not slow"` leaves them out), on one Ray (tests/conftest.py)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shared_ray")]

REQUIRED = ["step", "reward/mean", "response_length/mean", "actor/pg_loss", "actor/kl", "actor/grad_norm",
            "rollout/logprob_abs_diff", "timing/engine_busy_frac", "timing/step_s"]


def _row(content, truth, source="math__synthetic_arithmetic"):
    return {"data_source": source, "prompt": [{"role": "user", "content": content}], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": {"split": "train", "index": 0}}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    model = build_quickstart_model(root / "model")
    rows = [_row(f"{a}+{a}", str(2 * a)) for a in range(7)] + [_row("1+1", "2", source="test_hang__x")]
    rows += [_row(" ".join(["1+1"] * 40), "2"),  # over data.max_prompt_length (32): filtered and counted
             {**_row("2+2", "4"), "prompt": []}]  # a bad row: skipped and counted under data.on_bad_row=skip
    pq.write_table(pa.Table.from_pylist(rows), root / "train.parquet", row_group_size=3)
    cfg = load_config("configs/quickstart.yaml", [
        f"output_dir={root / 'out'}", f"model.path={model}", f"data.train_files=[{root / 'train.parquet'}]",
        "data.batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=2", "trainer.total_steps=3",
        "reward.timeout_s=1", "tracking.wandb=true", "reward.custom={test_hang: 'tests.reward_fixtures:never_returns'}",
        "algorithm.kl_in_reward_coef=0.01", "algorithm.kl_in_reward_target=0.1", "data.on_bad_row=skip",
        "tracking.swanlab=true", "tracking.tensorboard=true", "trainer.dump_rollouts_every=2",
        "rollout.stop=['\\boxed{1']",  # a stop string inside ten of the answer tokens: many responses end early
    ])
    out = train(cfg)
    return out, [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_every_step_is_logged_with_the_required_metrics(run):
    _, records = run
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        assert all(key in record and record[key] is not None for key in REQUIRED), record


def test_skipped_rows_are_logged_per_step(run):
    _, records = run  # 3 steps of 4 prompts from 8 good rows: every row of the file is read at least once
    for kind in ("bad_rows", "too_long"):
        per_step = [r[f"data/skipped_{kind}"] for r in records]
        assert sum(per_step) >= 1 and sum(per_step) == records[-1][f"data/skipped_{kind}_total"], (kind, per_step)


def test_kl_in_reward_is_applied_and_its_coefficient_adapts(run):
    _, records = run
    assert records[0]["reward/kl"] == pytest.approx(0.0, abs=1e-6)  # step 1: policy == reference
    assert records[0]["reward/kl_coef"] == pytest.approx(0.01)
    assert records[-1]["reward/kl"] > 0  # the policy moved away from the reference
    assert records[-1]["reward/kl_coef"] < 0.01  # KL below the target so far: the coefficient shrank


def test_engine_samples_from_the_trainers_weights_at_every_step(run):
    out, records = run
    assert all(r["rollout/logprob_abs_diff"] <= 1e-6 for r in records)  # the README's figure (mean, fp32)
    assert all(r["rollout/logprob_abs_diff_max"] <= 1e-5 for r in records)
    # responses that ended at the stop string: at the token completing it, their log-probs the trainer's too
    lines = [json.loads(line) for line in (out / "rollouts" / "step_000002.jsonl").read_text().splitlines()]
    stopped = [line for line in lines if "\\boxed{1" in line["response_tokens"][-1]]
    assert stopped and all(line["finish_reason"] == "stop" and line["logprob_diff_max"] <= 1e-5 for line in stopped)
    assert not any("\\boxed{1" in token for line in lines for token in line["response_tokens"][:-1])


def test_hanging_reward_costs_timeouts_and_the_run_goes_on(run):
    _, records = run
    timeouts = sum(r.get("reward/timeouts/test_hang", 0) for r in records)
    assert timeouts >= 4 and timeouts % 4 == 0  # each appearance of the row: n=4 samples, each one timeout
    assert sum(r["reward/timeouts"] for r in records) == timeouts
    assert all(r["reward/errors"] == 0 for r in records)


def test_hf_checkpoint_and_wandb_offline_run_are_written(run):
    out, _ = run
    model = AutoModelForCausalLM.from_pretrained(out / "hf")
    tokenizer = AutoTokenizer.from_pretrained(out / "hf")
    assert model.config.vocab_size == len(tokenizer)
    assert list((out / "wandb").glob("offline-run-*"))


def test_swanlab_and_tensorboard_hold_the_metrics_jsonl_values(run):
    out, records = run
    expected = {(key, r["step"]): value for r in records for key, value in r.items()
                if key != "step" and isinstance(value, int | float)}
    [swanlab] = _swanlab(out)
    assert swanlab.keys() == expected.keys() and _tensorboard(out).keys() == expected.keys()
    assert swanlab == pytest.approx(expected) and _tensorboard(out) == pytest.approx(expected)


def test_every_second_steps_rollouts_are_dumped_with_their_text_and_logprob_differences(run):
    out, records = run
    assert [path.name for path in (out / "rollouts").iterdir()] == ["step_000002.jsonl"]
    lines = [json.loads(line) for line in (out / "rollouts" / "step_000002.jsonl").read_text().splitlines()]
    assert len(lines) == 16  # 4 prompts x 4 samples
    assert sum(line["score"] for line in lines) / 16 == pytest.approx(records[1]["reward/mean"])
    assert all("+" in line["prompt"] and line["data_source"] for line in lines)
    assert all(line["response_length"] == len(line["logprob_diff"]) for line in lines)
    assert max(line["logprob_diff_max"] for line in lines) == pytest.approx(records[1]["rollout/logprob_abs_diff_max"])


def test_dapo_dynamic_sampling_run(tmp_path):
    _, records = _short_run(
        tmp_path, "configs/algorithms/dapo.yaml", "algorithm.max_num_gen_batches=3",
        "trainer.save_hf=false", "data.mix_weights={math__synthetic: 1.0}",  # the mixed stream, one source
        rows=[_row(f"{a}+{b}", str(a + b)) for a in range(4) for b in range(4)])
    for record in records:
        assert 1 <= record["dynamic_sampling/gen_batches"] <= 3
        assert record["reward/calls"] == 16 * record["dynamic_sampling/gen_batches"]  # every batch scored
        if record["dynamic_sampling/gen_batches"] < 3:
            assert record["dynamic_sampling/filled_groups"] == 0


@pytest.mark.parametrize("metric", ["acc", "score"])
def test_dynamic_sampling_filters_on_the_chosen_metric(tmp_path, metric):
    """Every response is correct (acc 1) but scores differ: on `acc` no group carries a signal, so each step
    samples its 2 batches and fills up with set-aside groups; on `score` groups vary and are kept."""
    _, records = _short_run(
        tmp_path, "configs/algorithms/dapo.yaml", "algorithm.max_num_gen_batches=2", "trainer.save_hf=false",
        f"algorithm.filter_groups_metric={metric}",
        "reward.custom={test_acc: 'tests.algo_fixtures:always_correct_varied_score'}",
        rows=[_row(f"{a}+{a}", str(2 * a), source="test_acc__x") for a in range(8)])
    for record in records:
        if metric == "acc":
            assert record["dynamic_sampling/gen_batches"] == 2 and record["dynamic_sampling/filled_groups"] == 4
        else:
            assert record["dynamic_sampling/filled_groups"] < 4


@pytest.mark.parametrize("keep", ["[done,length]", "[abort]"])
def test_partial_dynamic_filtering_trains_on_the_kept_trajectories(tmp_path, keep):
    """PyVision's partial dynamic filtering: every ending kept, scores that vary unless a group's responses are
    identical: whole groups kept, a second batch only when a group was dropped, 16 trajectories trained on; an
    ending no single response has (abort) kept: nothing is, the two batches allowed are sampled and set-aside
    trajectories fill the step, still exactly 16."""
    _, records = _short_run(
        tmp_path, "configs/algorithms/dapo.yaml", "algorithm.max_num_gen_batches=2", "trainer.save_hf=false",
        "algorithm.filter_groups_metric=score", "algorithm.partial_filter=true",
        f"algorithm.partial_filter_keep={keep}",
        "reward.custom={test_acc: 'tests.algo_fixtures:always_correct_varied_score'}",
        rows=[_row(f"{a}+{a}", str(2 * a), source="test_acc__x") for a in range(8)])
    for record in records:
        assert record["dynamic_sampling/trained_trajectories"] == 16
        if keep == "[abort]":
            assert record["dynamic_sampling/gen_batches"] == 2 and record["dynamic_sampling/filled_trajectories"] == 16
        elif record["dynamic_sampling/gen_batches"] == 1:  # every group varied: all of them, whole
            assert record["dynamic_sampling/filled_trajectories"] == 0
            assert record["dynamic_sampling/partial_groups"] == 0
        assert record["reward/calls"] == 16 * record["dynamic_sampling/gen_batches"]


def _short_run(tmp_path, *overrides: str, rows: list[dict] | None = None, moe: bool = False,
               moe_layers: int = 2) -> tuple:
    """Two steps of the quickstart model (with `moe`, a Qwen2-MoE of `moe_layers` layers over its tokenizer instead)
    on `rows` (default:
    eight addition prompts); overrides (presets or key=value) follow the base settings. Returns (output dir,
    metric records)."""
    model = build_quickstart_model(tmp_path / "model")
    if moe:
        _replace_with_qwen2_moe(model, moe_layers)
    rows = rows or [_row(f"{a}+{a}", str(2 * a)) for a in range(8)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    cfg = load_config("configs/quickstart.yaml", [
        f"output_dir={tmp_path / 'out'}", f"model.path={model}", f"data.train_files=[{tmp_path / 'train.parquet'}]",
        "data.batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=2", "trainer.total_steps=2", *overrides,
    ])
    out = train(cfg)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    return out, records


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_model_parallel_run_keeps_engine_and_trainer_in_step(tmp_path, tp, pp):
    """Two steps with the policy split over two ranks: the weights each rank streams into the engine after
    an update are the trainer's (the engine's log-probs equal the trainer's), and the saved model loads."""
    out, records = _short_run(tmp_path, f"actor.parallel.tensor={tp}", f"actor.parallel.pipeline={pp}",
                              "actor.micro_batch_size=3")
    assert all(r["rollout/logprob_abs_diff"] <= 1e-6 and r["rollout/logprob_abs_diff_max"] <= 1e-5
               and r["actor/pg_loss"] is not None for r in records)
    AutoModelForCausalLM.from_pretrained(out / "hf")


def _replace_with_qwen2_moe(model_dir, num_layers: int = 2) -> None:
    """The quickstart directory's model swapped for a tiny Qwen2-MoE (4 experts, top-2, a shared expert) over the
    same tokenizer."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    dense = json.loads((model_dir / "config.json").read_text())
    torch.manual_seed(0)
    config = Qwen2MoeConfig(vocab_size=dense["vocab_size"], hidden_size=64, intermediate_size=128,
                            moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4,
                            num_experts_per_tok=2, num_hidden_layers=num_layers, num_attention_heads=4,
                            num_key_value_heads=2,
                            max_position_embeddings=256, tie_word_embeddings=True, initializer_range=0.1,
                            eos_token_id=dense["eos_token_id"], pad_token_id=dense["pad_token_id"], bos_token_id=None)
    (model_dir / "model.safetensors").unlink()
    Qwen2MoeForCausalLM(config).save_pretrained(str(model_dir))


def test_mixture_of_experts_run_with_expert_parallelism_keeps_engine_and_trainer_in_step(tmp_path):
    """Qwen2-MoE at DP=2 x EP=2: both ranks stream their experts into the engine after each update, whose
    log-probs then equal the trainer's; the experts move, and the saved model loads in transformers."""
    out, records = _short_run(tmp_path, "actor.parallel.data=2", "actor.parallel.expert=2",
                              "actor.micro_batch_size=3", moe=True)
    for record in records:
        assert record["actor/grad_norm"] > 0 and math.isfinite(record["actor/pg_loss"]), record
        assert record["rollout/logprob_abs_diff"] <= 1e-6 and record["rollout/logprob_abs_diff_max"] <= 1e-5
    initial = AutoModelForCausalLM.from_pretrained(tmp_path / "model").state_dict()
    trained = AutoModelForCausalLM.from_pretrained(out / "hf").state_dict()
    moved = [name for name in initial if not torch.equal(initial[name], trained[name])]
    assert any(".mlp.experts." in name for name in moved) and any(".mlp.gate." in name for name in moved), moved


def test_experts_over_interleaved_pipeline_stages_train_and_sync(tmp_path):
    """A 4-layer Qwen2-MoE at DP=2 x EP=2 x PP=2 x VPP=2 (4 ranks, each holding two layer chunks and half of their
    experts): the update moves it and the engine samples from exactly the trainer's weights after each sync."""
    _, records = _short_run(tmp_path, "actor.parallel.data=2", "actor.parallel.expert=2", "actor.parallel.pipeline=2",
                            "actor.parallel.virtual_pipeline=2", "actor.micro_batch_size=3", moe=True, moe_layers=4)
    assert any(record["actor/grad_norm"] > 1e-3 for record in records), records
    for record in records:
        assert record["rollout/logprob_abs_diff"] <= 1e-6 and record["rollout/logprob_abs_diff_max"] <= 1e-5


def test_tensor_pipeline_and_data_parallel_at_once_train_and_sync(tmp_path):
    """TP=2 x PP=2 x DP=2 (8 policy ranks): the policy moves (a gradient every step, the saved weights differ
    from the initial ones) and the engine samples from exactly the trainer's weights after each update."""
    out, records = _short_run(tmp_path, "actor.parallel.tensor=2", "actor.parallel.pipeline=2",
                              "actor.parallel.data=2", "actor.micro_batch_size=3")
    for record in records:
        assert record["actor/grad_norm"] > 0 and math.isfinite(record["actor/pg_loss"]), record
        assert record["rollout/logprob_abs_diff"] <= 1e-6 and record["rollout/logprob_abs_diff_max"] <= 1e-5
    initial = AutoModelForCausalLM.from_pretrained(tmp_path / "model").state_dict()
    trained = AutoModelForCausalLM.from_pretrained(out / "hf").state_dict()
    assert initial.keys() == trained.keys()
    moved = [name for name in initial if not torch.equal(initial[name], trained[name])]
    assert "model.embed_tokens.weight" in moved and any(".mlp." in name for name in moved), moved
    assert all(torch.isfinite(tensor).all() for tensor in trained.values())


@pytest.mark.parametrize("overrides, metrics", [
    (["algorithm.adv_estimator=remax", "rollout.n=2"], ["reward/greedy_baseline_mean"]),
    (["algorithm.adv_estimator=gpg", "actor.loss_mode=gpg"], ["actor/pg_loss"]),
    (["configs/algorithms/ppo.yaml", "critic.warmup_steps=1"],
     ["critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm", "reward/kl"]),
    (["algorithm.adv_estimator=tests.algo_fixtures:unit_advantages",
      "actor.loss_mode=tests.algo_fixtures:constant_loss"], ["actor/pg_loss"]),
    (["configs/algorithms/grpo.yaml"], ["actor/pg_loss", "actor/kl"]),
    (["configs/algorithms/gspo.yaml"], ["actor/pg_loss", "actor/pg_clipfrac"]),
    (["configs/algorithms/drgrpo.yaml"], ["actor/pg_loss"]),
], ids=["remax", "gpg", "ppo", "plug-ins", "grpo-preset", "gspo-preset", "drgrpo-preset"])
def test_estimator_loss_and_preset_runs(tmp_path, overrides, metrics):
    _, records = _short_run(tmp_path, "trainer.save_hf=false", *overrides)
    for record in records:
        assert all(record.get(m) is not None and math.isfinite(record[m]) for m in metrics), record
    if "algorithm.adv_estimator=remax" in overrides:  # 4 prompts x 2 samples, and one greedy response each
        assert all(r["reward/calls"] == 4 * 2 + 4 and 0 <= r["reward/greedy_baseline_mean"] <= 1 for r in records)
    if "critic.warmup_steps=1" in overrides:  # one warm-up step trains only the critic
        assert "actor/pg_loss" not in records[0] and "actor/pg_loss" in records[1]
    if "actor.loss_mode=tests.algo_fixtures:constant_loss" in overrides:  # the policy ranks imported it
        assert all(r["actor/pg_loss"] == pytest.approx(CONSTANT_LOSS) for r in records), records


def test_an_unknown_data_source_stops_the_run_before_anything_starts(tmp_path, monkeypatch):
    def placed(*_):
        raise AssertionError("the run went on to placing its workers")

    monkeypatch.setattr("rl360.trainer._place", placed)
    rows = [_row("1+1", "2"), _row("2+2", "4", source="no_such_domain__x")]
    with pytest.raises(KeyError, match="no_such_domain__x"):
        _short_run(tmp_path, rows=rows)
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
