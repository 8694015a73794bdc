"""The engine fleet's dispatch, faults and memory calls over engines that implement the `Engine` protocol in
memory (no processes): sample j of prompt i is seeded `seed + i * n + j` however many engines share the prompts
and whichever of them fails; a failed engine's share goes to another one and the restart is counted; work goes
to the least-loaded engine; release and resume count the engines that did."""

import asyncio
from dataclasses import replace

import pytest

from rl360.cluster.placement import make_placement
from rl360.config import RolloutConfig
from rl360.core import Sample, SamplingParams
from rl360.rollout.engines import EngineDown
from rl360.rollout.fleet import EngineFleet


class MemoryEngine:
    """Answers each prompt's sample j with the one token `seed + i * n + j` (its seed); fails its first
    `failures` generate calls."""

    kind, url, log_path, supports_pause = "memory", "", None, False

    def __init__(self, index: int, failures: int = 0, delay_s: float = 0.0):
        self.index, self.failures, self.delay_s = index, failures, delay_s
        self.version, self.usable, self.restarts, self.calls = 0, False, 0, []
        self.released: set[str] = set()
        self.stopped = False

    async def start(self) -> None:
        return None

    async def alive(self) -> bool:
        return True

    async def generate(self, prompts, params, seed):
        self.calls.append(len(prompts))
        await asyncio.sleep(self.delay_s)
        if self.failures:
            self.failures -= 1
            raise EngineDown(f"engine {self.index} is down")
        return [[Sample(list(prompt), [seed + i * params.n + j], [0.0], "stop") for j in range(params.n)]
                for i, prompt in enumerate(prompts)]

    async def pause(self) -> bool:
        return False

    async def resume_generation(self) -> None:
        return None

    async def release(self, tags) -> bool:
        if set(tags) & self.released:
            return False
        self.released |= set(tags)
        return True

    async def resume(self, tags) -> bool:
        if not set(tags) & self.released:
            return False
        self.released -= set(tags)
        return True

    async def sync_weights(self, policy, version, peers, args) -> dict:
        return {}

    async def restart(self) -> None:
        self.restarts += 1

    def stop(self) -> None:
        self.stopped = True

    def describe(self) -> dict:
        return {"index": self.index, "kind": self.kind}


def _fleet(tmp_path, engines) -> EngineFleet:
    rollout = RolloutConfig(engine="server", num_engines=len(engines))
    return EngineFleet(rollout, None, make_placement(1, False, rollout, gpus=0), None, tmp_path, engines=engines)


def _draw(fleet: EngineFleet, prompts, params, seed, metrics=None, budgets=None):
    async def run():
        await fleet.start()
        try:
            groups = await fleet.generate(prompts, params, seed, metrics, budgets)
            await fleet._restarts_done()
            return groups
        finally:
            fleet.close()

    return asyncio.run(run())


PROMPTS = [[p] for p in range(7)]
PARAMS = SamplingParams(n=3, max_new_tokens=4)


@pytest.mark.parametrize("engines", [1, 2, 3])
def test_each_sample_is_seeded_by_its_position_however_many_engines_share_the_prompts(tmp_path, engines):
    metrics = {}
    groups = _draw(_fleet(tmp_path, [MemoryEngine(i) for i in range(engines)]), PROMPTS, PARAMS, 100, metrics)
    assert [[s.response_ids[0] for s in group] for group in groups] == [[100 + 3 * i + j for j in range(3)]
                                                                         for i in range(7)]
    assert [group[0].prompt_ids for group in groups] == PROMPTS
    if engines > 1:
        assert sum(metrics.values()) == 7 and all(count >= 2 for count in metrics.values()), metrics


def test_an_engine_marked_down_gets_no_share_and_the_samples_stay_the_same(tmp_path):
    engines = [MemoryEngine(i) for i in range(3)]
    fleet = _fleet(tmp_path, engines)

    async def run():
        await fleet.start()
        engines[1].usable = False  # down (e.g. awaiting a restart): dispatch passes it by
        try:
            return await fleet.generate(PROMPTS, PARAMS, 100)
        finally:
            fleet.close()

    groups = asyncio.run(run())
    assert [[s.response_ids[0] for s in group] for group in groups] == [[100 + 3 * i + j for j in range(3)]
                                                                         for i in range(7)]
    assert engines[1].calls == [] and sum(sum(engine.calls) for engine in engines) == 7


def test_a_failed_engines_share_goes_to_another_and_its_restart_is_counted(tmp_path):
    engines = [MemoryEngine(0), MemoryEngine(1, failures=1), MemoryEngine(2)]
    fleet = _fleet(tmp_path, engines)
    groups = _draw(fleet, PROMPTS, PARAMS, 100)
    assert [[s.response_ids[0] for s in group] for group in groups] == [[100 + 3 * i + j for j in range(3)]
                                                                         for i in range(7)]
    assert engines[1].restarts == 1 and fleet.restart_metrics() == {"rollout/engine_restarts": 1,
                                                                       "rollout/engine_restarts_total": 1}
    assert fleet.restart_metrics()["rollout/engine_restarts"] == 0  # counted once, at the next step's metrics
    assert engines[1].usable  # restarted before any weight update: it serves the weights the fleet expects
    assert all(engine.stopped for engine in engines)
    # 7 prompts over 3 engines: 2, 2 and 3; engine 1's 2 failed and went to another engine, not back to it
    assert engines[1].calls == [2] and sorted(engines[0].calls + engines[2].calls) == [2, 2, 3]


def test_an_engine_restarted_after_a_weight_update_waits_for_the_next_one(tmp_path):
    """At weight version 3 a restarted engine serves its checkpoint's weights: it takes no work until a weight
    update has reached it (the other engines draw everything meanwhile)."""
    engines = [MemoryEngine(0), MemoryEngine(1, failures=1)]
    fleet = _fleet(tmp_path, engines)

    async def run():
        await fleet.start()
        try:
            await fleet.sync_weights(3)
            first = await fleet.generate(PROMPTS, PARAMS, 100)
            await fleet._restarts_done()
            usable_after_restart = engines[1].usable
            calls_before = list(engines[1].calls)
            second = await fleet.generate(PROMPTS, PARAMS, 100)
            calls_between = list(engines[1].calls)
            await fleet.sync_weights(4)
            await fleet.generate(PROMPTS, PARAMS, 100)
            return first, second, usable_after_restart, calls_before, calls_between
        finally:
            fleet.close()

    first, second, usable_after_restart, calls_before, calls_between = asyncio.run(run())
    assert first == second  # the same samples, whoever drew them
    assert not usable_after_restart and calls_between == calls_before == [4]  # its failed share only
    assert len(engines[1].calls) == 2 and engines[1].version == 4  # back once the update reached it


class CuttingEngine(MemoryEngine):
    """Its first call comes back with 5 tokens of each sample, aborted (as an engine that failed does); later
    calls draw what their budget allows, token `100 + position in the response`."""

    async def generate(self, prompts, params, seed):
        self.calls.append((len(prompts), params.max_new_tokens))
        first = len(self.calls) == 1
        count = 5 if first else params.max_new_tokens
        return [[Sample(list(prompt), [99 + len(prompt) + k for k in range(count)], [0.0] * count,
                        "abort" if first else "length")] for prompt in prompts]


def test_an_aborted_sample_is_continued_up_to_its_own_budget_only(tmp_path):
    """`budgets` (the agent's batched turns): a sample aborted past its own budget is not continued; one aborted
    before it is continued up to it."""
    engine = CuttingEngine(0)
    groups = _draw(_fleet(tmp_path, [engine]), [[0], [1]], SamplingParams(n=1, max_new_tokens=12), 0,
                   budgets=[4, 9])
    [past], [short] = groups
    assert past.response_ids == [100, 101, 102, 103, 104] and past.resumed == 0 and past.finish_reason == "length"
    assert short.response_ids == list(range(100, 109)) and short.resumed == 1 and short.finish_reason == "length"
    assert engine.calls == [(2, 12), (1, 4)]  # one continuation, with the 4 tokens left of its budget


def test_more_restarts_than_allowed_stop_the_run(tmp_path):
    engines = [MemoryEngine(0, failures=5)]
    fleet = _fleet(tmp_path, engines)
    fleet.rollout = replace(fleet.rollout, max_engine_restarts=2)
    with pytest.raises(RuntimeError, match="more than rollout.max_engine_restarts=2"):
        _draw(fleet, PROMPTS, PARAMS, 0)


def test_work_goes_to_the_least_loaded_engine(tmp_path):
    engines = [MemoryEngine(0, delay_s=0.2), MemoryEngine(1, delay_s=0.2)]
    fleet = _fleet(tmp_path, engines)

    async def run():
        await fleet.start()
        engines[1].usable = False
        busy = asyncio.ensure_future(fleet.generate(PROMPTS, PARAMS, 0))  # all on engine 0
        await asyncio.sleep(0.05)
        engines[1].usable = True
        await fleet.generate([[9]], PARAMS, 0)  # one prompt, one part: the idle engine 1 takes it
        await busy
        fleet.close()

    asyncio.run(run())
    assert engines[0].calls == [7] and engines[1].calls == [1]


def test_release_and_resume_count_the_engines_that_did(tmp_path):
    engines = [MemoryEngine(0), MemoryEngine(1)]
    fleet = _fleet(tmp_path, engines)

    async def run():
        await fleet.start()
        counts = [await fleet.release(["weights", "kv_cache"]), await fleet.release(["weights"]),
                  await fleet.resume(["weights"]), await fleet.resume(["weights"]), await fleet.resume(["kv_cache"])]
        fleet.close()
        return counts

    assert asyncio.run(run()) == [2, 0, 2, 0, 2]


ENGINE_PARENT = """
import asyncio, sys, time
from pathlib import Path
from rl360.rollout.engines import EngineProcess, engine_command, new_api_key
key = new_api_key()
engine = EngineProcess(0, engine_command("server", sys.argv[1], "float32"), Path(sys.argv[2]), key, 120.0)
asyncio.run(engine.start())
print(engine.pid(), flush=True)
time.sleep(600)
"""


def test_an_engine_process_dies_with_the_process_that_started_it(tmp_path):
    """A trainer killed by SIGKILL (the OOM killer, Slurm) must not leave its engine processes serving, and holding
    their GPUs: they run in sessions of their own, so only the parent-death signal ends them."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.helpers import make_tiny_qwen2

    model = make_tiny_qwen2(str(tmp_path / "model"), tie_word_embeddings=True)
    parent = subprocess.Popen([sys.executable, "-c", ENGINE_PARENT, model, str(tmp_path / "engine.log")],
                              stdout=subprocess.PIPE, text=True)
    try:
        engine_pid = int(parent.stdout.readline())
        assert os.getsid(engine_pid) != os.getsid(parent.pid)  # out of the parent's session: killpg would miss it
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 30
        while _running(engine_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(engine_pid), "the engine outlived the process that started it"
    finally:
        parent.kill()


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
