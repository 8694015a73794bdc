"""Training with rollout engines as processes (`rl360 serve rollout`, SGLang's protocol) behind the engine fleet.

Real runs on the quickstart model: two engine processes with weights sent over a gloo group, and runs (three
seeds) in which one engine process is SIGKILLed from outside while it decodes a request; each must end exactly as
the unbroken run does, every metric and every exported weight (server engines seed every sample by its position,
so which engine drew it does not matter), with the restart counted. (A one-engine async run with shared-memory
weights: tests/test_resume.py's async run.) The fleet's dispatch is
checked on its own too: the same seed gives the same samples from one engine, from two, and from two with one
marked down.
"""

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import replace

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoTokenizer

from rl360.cluster.placement import make_placement
from rl360.config import load_config
from rl360.core import SamplingParams
from rl360.quickstart.assets import build_quickstart_model
from rl360.rollout.fleet import EngineFleet
from rl360.trainer import train

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shared_ray")]  # one Ray for the runs (conftest)
STEPS = 6


def _row(a: int, b: int) -> dict:
    return {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"{a}+{b}"}], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)}, "extra_info": {"index": a * 10 + b}}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("managed")
    model = build_quickstart_model(root / "model")
    pq.write_table(pa.Table.from_pylist([_row(a, b) for a in range(5) for b in range(5)]), root / "train.parquet")
    return root, model


def _overrides(assets, out, *extra) -> list[str]:
    root, model = assets
    return [f"output_dir={out}", f"model.path={model}", f"data.train_files=[{root / 'train.parquet'}]",
            "data.batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=4", f"trainer.total_steps={STEPS}",
            "trainer.save_hf=false", "trainer.num_threads=1", "rollout.engine=server", *extra]


def _metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _train(assets, name, *extra) -> tuple:
    out = assets[0] / name
    train(load_config("configs/quickstart.yaml", _overrides(assets, out, *extra)))
    return out, _metrics(out)


@pytest.fixture(scope="module")
def two_engines(assets):
    return _train(assets, "two", "rollout.num_engines=2", "rollout.weight_sync=distributed", "rollout.colocate=true",
                  "trainer.save_hf=true")


def test_two_engines_sample_from_the_trainers_weights_at_every_step(two_engines):
    _, metrics = two_engines
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    for m in metrics:
        assert m["rollout/logprob_abs_diff"] <= 1e-6, m  # the engines serve exactly the trainer's weights
        assert m["rollout/staleness_max"] == 0 and m["rollout/engine_restarts"] == 0
        assert m["rollout/engine0_prompts"] == m["rollout/engine1_prompts"] == 4  # 8 prompts over two engines
        assert m["reward/calls"] == 8 * 4
        assert m["rollout/engines_released"] == 2  # colocated: both freed their memory for the update


def test_engine_processes_are_listed_and_stopped(two_engines):
    out, _ = two_engines
    engines = json.loads((out / "rollout" / "engines.json").read_text())
    assert [e["index"] for e in engines] == [0, 1] and all(e["url"].startswith("http://127.0.0.1:") for e in engines)
    for engine in engines:
        assert not _alive(engine["pid"]), engine  # the run stopped its engines
        assert "serving rollout engine" in (out / "rollout" / f"engine-{engine['index']}.log").read_text()


def test_samples_do_not_depend_on_how_many_engines_drew_them(assets):
    """Sample j of prompt i is seeded `seed + i * n + j` whichever engine draws it: two engines, one engine, and
    two engines with either marked down give the same tokens and log-probs."""
    root, model = assets
    cfg = load_config("configs/quickstart.yaml", _overrides(assets, root / "seeds", "rollout.num_engines=2"))
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [tokenizer.encode(f"{a}+{b}=") for a in range(4) for b in range(2)]
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=12)
    placement = make_placement(1, False, cfg.rollout, gpus=0)

    async def draw() -> tuple[dict, dict]:
        fleets = {engines: EngineFleet(replace(cfg.rollout, num_engines=engines), cfg.model, placement, None,
                                       root / "seeds" / f"engines{engines}", num_threads=2) for engines in (1, 2)}
        try:
            await asyncio.gather(*(fleet.start() for fleet in fleets.values()))
            two, drawn = fleets[2], {}
            counts = {}
            drawn["one"] = await fleets[1].generate(prompts, params, 1234)
            drawn["two"] = await two.generate(prompts, params, 1234, counts)
            for down in (0, 1):
                two.engines[down].usable = False
                drawn[f"engine{down}_down"] = await two.generate(prompts, params, 1234)
                two.engines[down].usable = True
            return drawn, counts
        finally:
            for fleet in fleets.values():
                fleet.close()

    drawn, counts = asyncio.run(draw())
    assert counts == {"rollout/engine0_prompts": 4, "rollout/engine1_prompts": 4}  # both engines drew a share

    def tokens(groups) -> list:
        return [[sample.response_ids for sample in group] for group in groups]

    def logprobs(groups) -> torch.Tensor:  # equal up to float noise: an engine's batch holds other prompts
        return torch.tensor([lp for group in groups for sample in group for lp in sample.logprobs])

    reference = tokens(drawn["one"])
    assert len(reference) == 8 and all(len(group) == 4 for group in reference)
    assert len({tuple(ids) for group in reference for ids in group}) > 8  # the seeds do vary the samples
    for name in ("two", "engine0_down", "engine1_down"):
        assert tokens(drawn[name]) == reference, name
        assert torch.allclose(logprobs(drawn[name]), logprobs(drawn["one"]), atol=1e-4), name


def test_engines_placed_by_ray_serve_on_their_nodes_address(assets):
    """rollout.engine_hosts=ray: each engine process runs inside a Ray actor on the node Ray picks (here the one
    local node, but through the same path as on a cluster), serving on that node's address, not loopback."""
    out, metrics = _train(assets, "ray_hosts", "rollout.engine_hosts=ray", "rollout.num_engines=2",
                          "rollout.weight_sync=distributed")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert all(m["rollout/logprob_abs_diff"] <= 1e-6 and m["reward/calls"] == 32 for m in metrics)
    engines = json.loads((out / "rollout" / "engines.json").read_text())
    for engine in engines:
        assert engine["node"] != "local" and engine["url"].startswith(f"http://{engine['node']}:")
        assert not _alive(engine["pid"])  # the run stopped the process and its actor


def test_partial_rollouts_two_steps_ahead_train_and_stay_within_the_staleness_bound(assets):
    _, metrics = _train(assets, "partial", "rollout.mode=async", "rollout.max_staleness=2", "rollout.partial=true",
                        "rollout.num_engines=2", "rollout.max_response_length=16")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert all(m["reward/calls"] == 32 for m in metrics)  # every response scored once, cut by an update or not
    assert all(m["rollout/staleness_max"] <= 2 for m in metrics) and metrics[0]["rollout/staleness_max"] == 0
    assert all(m["rollout/resumed"] >= m["rollout/aborted"] for m in metrics)


@pytest.mark.parametrize("seed", [15, 0])  # (steps, engine): (1, 0), (2, 1)
def test_an_engine_killed_mid_request_is_restarted_and_nothing_changes(assets, two_engines, seed):
    """The victim (a seeded engine) is SIGKILLed after a seeded number of steps, the moment its `/metrics` says it is
    decoding: the kill lands inside a generate request, which the fleet sees fail and sends to the other engine."""
    unbroken_out, unbroken = two_engines
    out = assets[0] / f"killed_{seed}"
    rng = random.Random(seed)
    after_steps, index = rng.randint(1, 3), rng.randint(0, 1)
    command = [sys.executable, "-m", "rl360.cli", "train", "configs/quickstart.yaml",
               *_overrides(assets, out, "rollout.num_engines=2", "rollout.weight_sync=distributed",
                             "rollout.colocate=true", "trainer.save_hf=true")]
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        victim = _wait_for_engine(out, index, run)
        while _steps_logged(out) < after_steps and run.poll() is None:
            time.sleep(0.02)
        _wait_until_decoding(victim, run)
        os.kill(victim["pid"], signal.SIGKILL)
        output, _ = run.communicate(timeout=600)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, output[-12000:]
    failures = [line for line in output.splitlines() if "restarting it" in line]
    print(f"engine {index} killed decoding after {after_steps} steps; the run said:", *failures, sep="\n")
    assert failures and f"rollout engine {index} failed" in failures[0]
    # a request in flight broke (httpx: the server closed the connection before or during its reply), not a refused
    # new one
    assert any(broke in failures[0] for broke in IN_FLIGHT_BROKEN), failures[0]
    metrics = _metrics(out)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert sum(m["rollout/engine_restarts"] for m in metrics) >= 1 and metrics[-1]["rollout/engine_restarts_total"] >= 1
    for broken, whole in zip(metrics, unbroken):  # every sample drawn and scored once, as in the unbroken run
        # all but timings and which engine did what (rollout/engine*: restarts, each engine's share, releases)
        changed = {key for key in whole if not key.startswith(("timing/", "rollout/engine", "weight_sync/seconds"))
                   and broken.get(key) != whole[key]}
        assert not changed, (broken["step"], sorted(changed))
    trained, reference = _hf_weights(out), _hf_weights(unbroken_out)
    assert trained.keys() == reference.keys()
    assert all(torch.equal(trained[name], reference[name]) for name in reference)


IN_FLIGHT_BROKEN = ("disconnected without sending a response", "peer closed connection without sending complete")


def _hf_weights(out) -> dict:
    from safetensors.torch import load_file

    return {name: tensor for path in sorted((out / "hf").glob("*.safetensors")) for name, tensor in
            load_file(str(path)).items()}


def _wait_until_decoding(engine: dict, run) -> None:
    """Poll the engine's `/metrics` (with the key the fleet gave it, read from its environment) until it reports a
    response being decoded."""
    environ = dict(item.split("=", 1) for item in
                   open(f"/proc/{engine['pid']}/environ").read().split("\0") if "=" in item)
    headers = {"Authorization": f"Bearer {environ['RL360_ROLLOUT_API_KEY']}"}
    deadline = time.monotonic() + 300
    with httpx.Client(timeout=5) as client:
        while time.monotonic() < deadline and run.poll() is None:
            text = client.get(f"{engine['url']}/metrics", headers=headers).text
            running = [line for line in text.splitlines() if line.startswith("rl360_rollout_requests_running")]
            if running and float(running[0].split()[-1]) > 0:
                return
    raise AssertionError(f"engine {engine['url']} never reported a response being decoded; run: {run.poll()}")


def _wait_for_engine(out, index: int, run) -> int:
    listing = out / "rollout" / "engines.json"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and run.poll() is None:
        if listing.exists():
            return json.loads(listing.read_text())[index]
        time.sleep(0.05)
    raise AssertionError(f"no engine list at {listing}; run exited with {run.poll()}")


def _steps_logged(out) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_through_sglang_router_an_engine_killed_mid_run_rejoins_with_current_weights_and_nothing_changes(
        assets, two_engines):
    """The same run with sglang-router in front of the two engines (rollout.router=sglang): engine 1 is SIGKILLed
    while it decodes in step 3. The run ends exactly as the unbroken run without a router (samples are seeded by
    their position, whichever engine the router picked), every sample from the step's weights (staleness 0), the
    restart counted; the engines' key is on no process's command line and in no file the run wrote."""
    pytest.importorskip("sglang_router")
    unbroken_out, unbroken = two_engines
    out = assets[0] / "routed_killed"
    command = [sys.executable, "-m", "rl360.cli", "train", "configs/quickstart.yaml",
               *_overrides(assets, out, "rollout.num_engines=2", "rollout.weight_sync=distributed",
                             "rollout.colocate=true", "trainer.save_hf=true", "rollout.router=sglang")]
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        victim = _wait_for_engine(out, 1, run)
        key = _engine_key(victim)
        while _steps_logged(out) < 2 and run.poll() is None:
            time.sleep(0.02)
        _wait_until_decoding(victim, run)
        os.kill(victim["pid"], signal.SIGKILL)
        command_lines = _command_lines_holding(key)
        output, _ = run.communicate(timeout=600)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, output[-12000:]
    assert not command_lines, command_lines
    assert "rollout engine 1 failed" in output, output[-6000:]
    metrics = _metrics(out)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert metrics[-1]["rollout/engine_restarts_total"] >= 1
    assert all(m["rollout/staleness_max"] == 0 and m["rollout/logprob_abs_diff"] <= 1e-6 for m in metrics)
    # engine log-probs round in their last bits by what a request was batched with (the router sends each prompt
    # alone): the figures made from them within fp32 rounding, everything else exact
    engine_figures = ("rollout/logprob_abs_diff", "rollout/logprob_abs_diff_max", "rollout/k3_kl")
    for routed, whole in zip(metrics, unbroken):
        changed = {k for k in whole if not k.startswith(("timing/", "rollout/engine", "weight_sync/seconds"))
                   and k not in engine_figures and routed.get(k) != whole[k]}
        assert not changed, (routed["step"], sorted(changed))
        assert all(abs(routed[k] - whole[k]) <= 1e-6 for k in engine_figures if k in whole), routed["step"]
    trained, reference = _hf_weights(out), _hf_weights(unbroken_out)
    assert all(torch.equal(trained[name], reference[name]) for name in reference)
    router_log = (out / "rollout" / "router.log").read_text()
    assert "rl360.rollout.router" in router_log  # the router ran, and logged where the run writes
    holding = [str(path) for path in out.rglob("*") if path.is_file() and key.encode() in path.read_bytes()]
    assert not holding, holding


def _engine_key(engine: dict) -> str:
    environ = dict(item.split("=", 1) for item in
                   open(f"/proc/{engine['pid']}/environ").read().split("\0") if "=" in item)
    return environ["RL360_ROLLOUT_API_KEY"]


def _command_lines_holding(key: str) -> list[str]:
    """Command lines of this machine's processes that hold `key`."""
    import psutil

    found = []
    for process in psutil.process_iter(["cmdline"]):
        line = " ".join(process.info["cmdline"] or [])
        if key in line:
            found.append(line)
    return found
