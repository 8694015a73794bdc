"""On-policy distillation: the reverse-KL advantage, a teacher served by `rl360 serve rollout` scoring the student's
samples (checked against a plain forward pass), the tokenizer check, and a training run whose teacher is the student
itself (reverse KL 0 at every token: the teacher's log-probs sit on the trainer's positions)."""

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from rl360.algos.distillation import distill_advantages
from rl360.config import ConfigError, DistillConfig, load_config
from rl360.core import Sample
from rl360.quickstart.assets import ARITHMETIC_WORDS, build_quickstart_model, build_tokenizer
from rl360.rollout.teacher import Teacher, tokenizer_mismatch


def test_the_advantage_adds_the_teachers_margin_on_trained_tokens_only():
    advantages = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, 0.0]])
    teacher = torch.tensor([[-0.5, -1.0, -3.0], [-0.1, -4.0, 0.0]])
    student = torch.tensor([[-1.0, -1.0, -1.0], [-0.2, -2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])  # row 0's last token a tool reply, row 1's padding
    combined, metrics = distill_advantages(advantages, teacher, student, mask, coef=2.0, reward_weight=0.5)
    expected = torch.tensor([[0.5 + 2 * 0.5, 0.5 + 0.0, 0.0], [-1.0 + 2 * 0.1, -1.0 + 2 * -2.0, 0.0]])
    torch.testing.assert_close(combined, expected)
    assert metrics["distill/reverse_kl"] == pytest.approx((-0.5 + 0.0 - 0.1 + 2.0) / 4)
    assert metrics["distill/teacher_logprob"] == pytest.approx((-0.5 - 1.0 - 0.1 - 4.0) / 4)
    alone, _ = distill_advantages(advantages, teacher, student, mask, coef=1.0, reward_weight=0.0)
    torch.testing.assert_close(alone, (teacher - student) * mask)


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    return build_quickstart_model(tmp_path_factory.mktemp("distill") / "student")


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    return build_quickstart_model(tmp_path_factory.mktemp("distill") / "teacher", seed=5)


def _settings(**overrides):
    return DistillConfig(**{"sequences_per_request": 2, "max_concurrency": 2, **overrides})


def test_served_teacher_scores_each_response_token_as_a_forward_pass_does(student, teacher_dir, tmp_path):
    samples = [Sample([3, 4, 5], [6, 7, 8], [0.0] * 3, "stop"),
               Sample([3, 9], [10, 11, 12, 13], [0.0] * 4, "stop", loss_mask=[1, 0, 0, 1]),  # tool reply in between
               Sample([3, 4], [], [], "length"),  # nothing sampled: nothing asked
               Sample([5], [6], [0.0], "stop")]

    async def score():
        teacher = await Teacher.open(_settings(teacher_model=str(teacher_dir)), SimpleNamespace(
            path=str(student), dtype="float32"), tmp_path)
        try:
            return await teacher.logprobs(samples)
        finally:
            await teacher.close()

    scored = asyncio.run(score())
    reference = AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    assert [len(values) for values in scored] == [3, 4, 0, 1]
    for sample, values in zip(samples, scored):
        if not sample.response_ids:
            continue
        ids = sample.prompt_ids + sample.response_ids
        with torch.no_grad():
            plain = torch.log_softmax(reference(torch.tensor([ids])).logits[0], -1)
        start = len(sample.prompt_ids)
        expected = torch.tensor([float(plain[k - 1, ids[k]]) for k in range(start, len(ids))])
        expected = expected * torch.tensor(sample.loss_mask or [1] * len(values), dtype=torch.float32)
        torch.testing.assert_close(torch.tensor(values), expected, atol=1e-5, rtol=0)
    assert (tmp_path / "teacher.log").exists()  # the served teacher's log, beside the engines'


def test_a_teacher_with_another_tokenizer_is_refused_in_one_line(student, tmp_path):
    assert tokenizer_mismatch(str(student), str(student)) is None
    swapped = tmp_path / "swapped"
    build_tokenizer(swapped, words=list(reversed(ARITHMETIC_WORDS)))
    assert "token" in tokenizer_mismatch(str(student), str(swapped)) and "for the teacher" in \
        tokenizer_mismatch(str(student), str(swapped))
    longer = tmp_path / "longer"
    build_tokenizer(longer, max_answer=30)
    assert "tokens against" in tokenizer_mismatch(str(student), str(longer))

    async def opened():
        teacher = await Teacher.open(_settings(teacher_model=str(student), teacher_tokenizer=str(longer)),
                                     SimpleNamespace(path=str(student), dtype="float32"), tmp_path)
        await teacher.close()

    with pytest.raises(ConfigError) as refused:
        asyncio.run(opened())
    message = str(refused.value)
    assert "\n" not in message and str(longer) in message and "must share a tokenizer" in message


def test_config_refuses_two_teachers(tmp_path):
    with pytest.raises(ConfigError, match="give one teacher"):
        load_config("configs/quickstart.yaml", ["distill.teacher_url=http://127.0.0.1:1",
                                                f"distill.teacher_model={tmp_path}"])


def _row(a, b):
    return {"data_source": "math__synthetic_arithmetic", "prompt": [{"role": "user", "content": f"{a}+{b}"}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"split": "train", "index": a * 10 + b}}


@pytest.mark.slow
def test_a_student_distilled_from_itself_sees_zero_reverse_kl(student, tmp_path):
    """The teacher is the student's own checkpoint: at step 1 the teacher's log-prob of every sampled token equals
    the trainer's (fp32), so the reverse KL is 0; the teacher is not the trained student's after that."""
    pq.write_table(pa.Table.from_pylist([_row(a, b) for a in range(4) for b in range(3)]), tmp_path / "train.parquet")
    cfg = load_config("configs/quickstart.yaml", [
        f"output_dir={tmp_path / 'out'}", f"model.path={student}", f"data.train_files=[{tmp_path / 'train.parquet'}]",
        "data.batch_size=4", "rollout.n=1", "actor.ppo_mini_batch_size=2", "trainer.total_steps=2",
        f"distill.teacher_model={student}", "distill.reward_weight=0", "rollout.max_response_length=3"])
    from rl360.trainer import train
    try:
        out = train(cfg)
    finally:
        ray.shutdown()
    records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    first, second = records
    assert abs(first["distill/reverse_kl"]) < 1e-5, first
    assert first["distill/teacher_logprob"] == pytest.approx(first["distill/student_logprob"], abs=1e-5)
    assert first["distill/teacher_logprob"] < -0.01  # sampled tokens, not certain ones: a real comparison
    # the first update moved the student (Adam scales even its near-zero gradients up); the teacher stays put
    assert abs(second["distill/reverse_kl"]) > 1e-3, second
    assert all(record["timing/teacher_s"] > 0 for record in records)
