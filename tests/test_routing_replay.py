"""MoE routing replay: the engines return the experts each token was routed to (the HF engine, and
`rl360 serve rollout` in SGLang's `routed_experts` form), the batch puts them in megatron's token order, and the
trainer's routers replay them: in bf16 its log-probs come closer to the engine's, in fp32 they are unchanged."""

import asyncio
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from rl360.actor.batch import build_batch
from rl360.actor.policy import PolicyWorker
from rl360.actor.routing_replay import megatron_order
from rl360.actor.settings import PolicySettings
from rl360.config import ConfigError, load_config
from rl360.core import SamplingParams
from rl360.core.client import EngineClient
from rl360.engine.hf_engine import HFEngine
from rl360.engine.routes import RouteRecorder
from tests.helpers import make_tiny_model, serving_url
from tests.test_policy import _config

PROMPTS = [[3 + i, 4 + i, 5, 6 + 2 * i, 7][: 3 + i % 3] for i in range(16)]  # lengths 3 to 5: left padding


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("replay") / "qwen3_moe"), "qwen3_moe",
                           tie_word_embeddings=False, seed=21, num_layers=2)


def _own_routes(model_dir, ids):
    """The HF model's routes for one sequence run whole: [len(ids), layers * top_k], each token's experts sorted."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    recorder = RouteRecorder(model)
    with torch.no_grad(), recorder.forward(1, len(ids)) as recorded:
        model(torch.tensor([ids]))
    return recorded[0][0].flatten(1)


def _sorted(routes, top_k=2):
    return routes.view(len(routes), -1, top_k).sort(-1).values


def test_the_engine_returns_the_experts_its_model_chose_for_every_token_it_ran(moe_dir):
    groups = HFEngine(moe_dir).generate(PROMPTS[:4], SamplingParams(n=2, max_new_tokens=6, seed=1,
                                                                    routed_experts=True))
    for sample in (s for group in groups for s in group):
        ids = sample.prompt_ids + sample.response_ids
        assert sample.routed_experts.shape == (len(ids) - 1, 2 * 2)  # prompt + response - 1 tokens, 2 layers x top-2
        assert torch.equal(_sorted(sample.routed_experts), _sorted(_own_routes(moe_dir, ids)[:-1]))
    plain = HFEngine(moe_dir).generate(PROMPTS[:1], SamplingParams(max_new_tokens=3))
    assert plain[0][0].routed_experts is None  # not asked for: not recorded


def test_the_server_answers_sglangs_routed_experts(moe_dir):
    proc = subprocess.Popen([sys.executable, "-m", "rl360.cli", "serve", "rollout", "--model", moe_dir, "--port",
                             "0", "--api-key-env", "RL360_TEST_REPLAY_KEY"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "RL360_TEST_REPLAY_KEY": "k" * 24})
    try:
        url = serving_url(proc)

        async def sample():
            async with EngineClient(url, api_key="k" * 24, timeout_s=60) as client:
                return await client.generate_samples(PROMPTS[:3], SamplingParams(n=2, max_new_tokens=5,
                                                                                 routed_experts=True), seed=3)

        groups = asyncio.run(sample())
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    for sample in (s for group in groups for s in group):
        ids = sample.prompt_ids + sample.response_ids
        assert sample.routed_experts.dtype == torch.int16 and sample.routed_experts.shape == (len(ids) - 1, 4)
        assert torch.equal(_sorted(sample.routed_experts), _sorted(_own_routes(moe_dir, ids)[:-1]))


def test_routes_go_in_megatrons_token_order_with_defaults_where_the_engine_ran_none():
    one = torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23]], dtype=torch.int16)  # 2 tokens, 2 layers x top-2
    two = torch.tensor([[30, 31, 32, 33]], dtype=torch.int16)
    batch = build_batch([[1, 2], [3]], [[4], [5]], [[0.0], [0.0]], routed_experts=[one, two])
    assert batch.routed_experts.shape == (2, 3, 4) and batch.routed_experts[1, 1:].eq(-1).all()
    padded = megatron_order(batch, 4, num_layers=2, top_k=2)  # sequence-major: s0b0, s0b1, s1b0, s1b1, ...
    assert padded.shape == (8, 2, 2)
    assert padded[0].flatten().tolist() == [10, 11, 12, 13] and padded[1].flatten().tolist() == [30, 31, 32, 33]
    assert padded[2].flatten().tolist() == [20, 21, 22, 23] and padded[3].flatten().tolist() == [0, 1, 0, 1]
    packed = megatron_order(batch, 1, num_layers=2, top_k=2, slots=[4, 2])  # slots back to back
    assert packed.shape == (6, 2, 2)
    assert [row.flatten().tolist()[0] for row in packed] == [10, 20, 0, 0, 30, 0]


def _engine_batch(model_dir, dtype):
    groups = HFEngine(model_dir, dtype=dtype).generate(PROMPTS, SamplingParams(
        n=4, max_new_tokens=24, temperature=0.9, seed=1, routed_experts=True))
    samples = [s for group in groups for s in group]
    return build_batch([s.prompt_ids for s in samples], [s.response_ids for s in samples],
                       [s.logprobs for s in samples], routed_experts=[s.routed_experts for s in samples])


@pytest.mark.parametrize("dtype, packed", [("bfloat16", False), ("float32", False), ("float32", True)],
                         ids=["bf16", "fp32", "fp32-packed"])
def test_replayed_routes_bring_the_trainer_to_the_engine(megatron_single_rank, moe_dir, dtype, packed):
    batch = _engine_batch(moe_dir, getattr(torch, dtype))
    logprobs = {replay: PolicyWorker(PolicySettings.of(_config(
        moe_dir, f"model.dtype={dtype}", "actor.micro_batch_size=16", f"actor.pack_sequences={str(packed).lower()}",
        f"actor.moe_routing_replay={str(replay).lower()}"))).compute_logprobs(batch)
                for replay in (False, True)}
    mask = batch.response_mask
    mean = {replay: ((lp - batch.rollout_logprobs).abs() * mask).sum().item() / mask.sum().item()
            for replay, lp in logprobs.items()}
    if dtype == "float32":  # the same routes either way: the same log-probs, to the bit
        assert torch.equal(logprobs[True], logprobs[False])
        assert mean[True] < 1e-5
    else:  # bf16 routers flip near-ties that the engine decided the other way: replay takes the engine's
        assert mean[True] < mean[False], mean


def test_replay_refuses_what_it_does_not_cover_and_dense_models(megatron_single_rank, tmp_path):
    with pytest.raises(ConfigError, match="does not work with actor.recompute=full"):
        load_config(None, ["model.path=x", "data.train_files=[x]", "actor.moe_routing_replay=true",
                           "actor.recompute=full"])
    dense = make_tiny_model(str(tmp_path / "dense"), "qwen3", tie_word_embeddings=False)
    with pytest.raises(ConfigError, match="is not a mixture of experts"):
        PolicyWorker(PolicySettings.of(_config(dense, "actor.moe_routing_replay=true")))


@pytest.mark.slow
def test_a_training_run_replays_the_engines_routes(tmp_path):
    """The whole path: the sampler asks the engine for routes, the batch carries them, both passes replay them."""
    from tests.test_train_e2e import _short_run

    _, records = _short_run(tmp_path, "actor.moe_routing_replay=true", "model.dtype=bfloat16",
                            "rollout.max_response_length=4", moe=True)
    assert all(r["rollout/routes_missing"] == 0 for r in records)
