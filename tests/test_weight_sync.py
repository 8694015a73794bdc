"""Weight sync into two real `rl360 serve rollout` processes (a tiny Qwen2), driven by `WeightSender` from this
process: every strategy leaves every engine's weights bitwise equal to what was sent (read back through
SGLang's `/get_weights_by_name`, whose float32 values survive JSON exactly), in float32 and in bfloat16; partial
and stale updates are refused by name while the old weights and version stay, and a second, different partial
update at the same version is refused too; a restarted engine rejoins through `set_engines`;
memory release and resume; a sender in a process that already has a default process group."""

import asyncio
import base64
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import httpx
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from rl360.config import ConfigError
from rl360.core.client import EngineClient, EngineError
from rl360.weight_sync.formats import (
    SHARED_MEMORY_LOAD_FORMAT,
    decode_tensor_bucket,
    encode_tensor_bucket,
    read_shared_bucket,
    write_shared_bucket,
)
from rl360.weight_sync.sender import WeightSender
from tests.helpers import make_tiny_qwen2, serving_url

KEY = "weight-sync-test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
STRATEGIES = ("distributed", "tensor", "disk")
WHOLE = 1 << 30  # a truncate_size past every parameter's rows


class Engines:
    """The module's two server processes; `kill(i)` ends engine i at once, `start(i)` puts a new process (with a
    new URL) in its place."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self.procs = [_launch(model_dir) for _ in range(2)]
        self.urls = [serving_url(proc) for proc in self.procs]

    def kill(self, index: int) -> None:
        self.procs[index].send_signal(signal.SIGKILL)
        self.procs[index].communicate(timeout=30)

    def start(self, index: int) -> str:
        self.procs[index] = _launch(self.model_dir)
        self.urls[index] = serving_url(self.procs[index])
        return self.urls[index]

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.communicate(timeout=30)


def _launch(model_dir: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rl360.cli", "serve", "rollout", "--model", model_dir, "--port",
                             "0", "--api-key-env", "RL360_TEST_ROLLOUT_KEY", "--batch-window-ms", "1",
                             "--weight-sync-timeout-s", "30", "--shutdown-grace", "5", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "RL360_TEST_ROLLOUT_KEY": KEY, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    model_dir = make_tiny_qwen2(str(tmp_path_factory.mktemp("weight_sync") / "model"), tie_word_embeddings=False,
                                seed=5)
    servers = Engines(model_dir)
    yield servers
    servers.stop()


def _run(coro):
    return asyncio.run(coro)


async def _each(urls, fn):
    results = []
    for url in urls:
        async with EngineClient(url, api_key=KEY, timeout_s=60) as client:
            results.append(await fn(client))
    return results


def _weights(model_dir: str, seed: int) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's parameters, each moved by seeded noise (a different set of weights per seed)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    generator = torch.Generator().manual_seed(seed)
    return [(name, param.detach() + 0.05 * torch.randn(param.shape, generator=generator))
            for name, param in model.named_parameters()]


def _buckets(named: list, count: int = 3) -> list[list]:
    size = -(-len(named) // count)
    return [named[i:i + size] for i in range(0, len(named), size)]


def _served(urls, names) -> dict[str, dict[str, torch.Tensor]]:
    """Every parameter of every engine, read back with /get_weights_by_name, as float32 tensors."""
    async def read(client):
        return {name: torch.tensor(await client.get_weights_by_name(name, WHOLE), dtype=torch.float32)
                for name in names}

    return dict(zip(urls, _run(_each(urls, read))))


def _assert_bitwise(served: dict[str, torch.Tensor], named) -> None:
    assert set(served) == {name for name, _ in named}
    for name, tensor in named:
        assert served[name].shape == tensor.shape, name
        assert torch.equal(served[name].view(torch.int32), tensor.view(torch.int32)), f"{name} differs"


def _versions(urls) -> list[int]:
    return [int(v) for v in _run(_each(urls, lambda client: client.weight_version()))]


@pytest.fixture(scope="module")
def names(engines):
    return [name for name, _ in AutoModelForCausalLM.from_pretrained(engines.model_dir).named_parameters()]


def _sender(engines, strategy, tmp_path, **kwargs) -> WeightSender:
    return WeightSender(list(engines.urls), strategy, api_key=KEY, timeout_s=30, scratch_dir=str(tmp_path), **kwargs)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_engine_ends_bitwise_equal_to_what_was_sent(engines, names, strategy, tmp_path):
    named = _weights(engines.model_dir, seed=1 + STRATEGIES.index(strategy))
    version = max(_versions(engines.urls)) + 1
    with _sender(engines, strategy, tmp_path) as sender:
        metrics = sender.send(_buckets(named), version)
    assert metrics["weight_sync/bytes"] == sum(t.numel() * t.element_size() for _, t in named)
    assert metrics["weight_sync/buckets"] == 3 and metrics["weight_sync/tensors"] == len(named)
    assert metrics["weight_sync/seconds"] > 0
    assert list(tmp_path.iterdir()) == []  # shared-memory files and checkpoint shards are removed
    assert _versions(engines.urls) == [version, version]
    for served in _served(engines.urls, names).values():
        _assert_bitwise(served, named)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_partial_update_is_refused_by_name_and_the_old_weights_stay(engines, names, strategy, tmp_path):
    before_versions, before = _versions(engines.urls), _served(engines.urls, names)
    named = _weights(engines.model_dir, seed=10 + STRATEGIES.index(strategy))
    left_out = names[4]
    version = max(before_versions) + 1
    with _sender(engines, strategy, tmp_path) as sender:
        with pytest.raises(EngineError, match="left parameters unset") as refused:
            sender.send(_buckets([pair for pair in named if pair[0] != left_out]), version)
        assert left_out in str(refused.value)
        assert all(url in str(refused.value) for url in engines.urls)  # each engine refused, each is named
        assert _versions(engines.urls) == before_versions
        for url, served in _served(engines.urls, names).items():  # the buckets that did arrive were not loaded either
            _assert_bitwise(served, list(before[url].items()))
        # a different partial update at the same version: refused too, for what it lacks (an engine that kept the
        # refused update's buckets would complete this one with them)
        other = _weights(engines.model_dir, seed=40 + STRATEGIES.index(strategy))
        with pytest.raises(EngineError, match="left parameters unset") as refused_again:
            sender.send(_buckets([pair for pair in other if pair[0] != names[5]]), version)
        assert names[5] in str(refused_again.value)
        assert _versions(engines.urls) == before_versions
        for url, served in _served(engines.urls, names).items():
            _assert_bitwise(served, list(before[url].items()))
        group = sender.group_name
        sender.send(_buckets(named), version)  # the same sender (and group) goes on
        assert sender.group_name == group
    assert list(tmp_path.iterdir()) == []
    for served in _served(engines.urls, names).values():
        _assert_bitwise(served, named)


@pytest.fixture(scope="module")
def bf16_engine(engines):
    proc = _launch(engines.model_dir, "--dtype", "bfloat16")
    yield serving_url(proc)
    proc.terminate()
    proc.communicate(timeout=30)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bf16_weights_arrive_bit_for_bit(engines, names, bf16_engine, strategy, tmp_path):
    """bf16 tensors sent to a bf16 engine are served with the same bits (bf16 widens to float32 exactly, so the
    JSON read-back holds every bit); values that differ only past bf16's 8 bits of mantissa would not pass."""
    named = [(name, tensor.to(torch.bfloat16))
             for name, tensor in _weights(engines.model_dir, seed=50 + STRATEGIES.index(strategy))]
    version = _versions([bf16_engine])[0] + 1
    with WeightSender([bf16_engine], strategy, api_key=KEY, timeout_s=30, scratch_dir=str(tmp_path)) as sender:
        metrics = sender.send(_buckets(named), version)
    assert metrics["weight_sync/bytes"] == sum(t.numel() * 2 for _, t in named)  # sent as bf16, not widened
    assert _versions([bf16_engine]) == [version]
    served = _served([bf16_engine], names)[bf16_engine]
    for name, tensor in named:
        assert served[name].shape == tensor.shape, name
        assert torch.equal(served[name].to(torch.bfloat16).view(torch.int16), tensor.view(torch.int16)), name
        assert torch.equal(served[name], tensor.float()), name  # nothing beyond bf16's bits was kept


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_older_version_is_refused(engines, names, strategy, tmp_path):
    versions, before = _versions(engines.urls), _served(engines.urls, names)
    named = _weights(engines.model_dir, seed=20 + STRATEGIES.index(strategy))
    with _sender(engines, strategy, tmp_path) as sender:
        with pytest.raises(EngineError, match="older than the served version"):
            sender.send(_buckets(named), min(versions) - 1)
        assert _versions(engines.urls) == versions
        for url, served in _served(engines.urls, names).items():
            _assert_bitwise(served, list(before[url].items()))
        group = sender.group_name
        sender.send(_buckets(named), max(versions) + 1)
        assert sender.group_name == group  # the engines received the refused broadcasts: the group goes on
    assert _versions(engines.urls) == [max(versions) + 1] * 2


def test_a_restarted_engine_rejoins_through_set_engines(engines, names, tmp_path):
    first = _weights(engines.model_dir, seed=30)
    version = max(_versions(engines.urls)) + 1
    with _sender(engines, "distributed", tmp_path) as sender:
        sender.send(_buckets(first), version)
        first_group, killed = sender.group_name, engines.urls[1]
        engines.kill(1)
        with pytest.raises(EngineError, match="unreachable") as gone:  # at once, not after a time-out
            sender.send(_buckets(first), version + 1)
        assert killed in str(gone.value) and sender.group_name is None
        reply = httpx.post(f"{engines.urls[0]}/destroy_weights_update_group", json={"group_name": first_group},
                           headers=AUTH, timeout=30)
        assert reply.status_code == 400 and "does not exist" in reply.json()["message"]  # dropped on the survivor
        engines.start(1)
        sender.set_engines(list(engines.urls))
        second = _weights(engines.model_dir, seed=31)
        sender.send(_buckets(second), version + 1)
        second_group = sender.group_name
        assert second_group not in (None, first_group)
        sender.set_engines(list(engines.urls))  # same membership: the group is destroyed on both engines
        for url in engines.urls:
            reply = httpx.post(f"{url}/destroy_weights_update_group", json={"group_name": second_group},
                               headers=AUTH, timeout=30)
            assert reply.status_code == 400, url
        sender.send(_buckets(second), version + 2)
        assert sender.group_name not in (None, second_group)
    assert _versions(engines.urls) == [version + 2] * 2
    for served in _served(engines.urls, names).values():
        _assert_bitwise(served, second)


def test_an_engine_that_lost_the_group_fails_the_send_and_the_next_send_regroups(engines, names, tmp_path):
    first, second = _weights(engines.model_dir, seed=70), _weights(engines.model_dir, seed=71)
    version = max(_versions(engines.urls)) + 1
    with _sender(engines, "distributed", tmp_path) as sender:
        sender.send(_buckets(first), version)
        group = sender.group_name
        reply = httpx.post(f"{engines.urls[1]}/destroy_weights_update_group", json={"group_name": group},
                           headers=AUTH, timeout=30)
        assert reply.json() == {"success": True, "message": "Succeeded to destroy custom process group."}
        started = time.monotonic()
        with pytest.raises(EngineError, match="is not an open weight-update group") as lost:
            sender.send(_buckets(second), version + 1)  # engine 1 refuses before receiving; engine 0 receives
        assert time.monotonic() - started < 10  # within the grace after the replies, far below timeout_s (30)
        assert engines.urls[1] in str(lost.value) and sender.group_name is None
        sender.send(_buckets(second), version + 1)
        assert sender.group_name not in (None, group)
    assert _versions(engines.urls) == [version + 1] * 2
    for served in _served(engines.urls, names).values():
        _assert_bitwise(served, second)


def test_an_unreachable_engine_fails_the_group_at_once(engines):
    closed = "http://127.0.0.1:9"  # the discard port: nothing listens
    with WeightSender([engines.urls[0], closed], "distributed", api_key=KEY, timeout_s=3) as sender:
        with pytest.raises(EngineError, match="unreachable") as failed:  # at once, not after the 3 s time-out
            sender.send(_buckets(_weights(engines.model_dir, seed=40)), max(_versions(engines.urls)) + 1)
    assert closed in str(failed.value) and sender.group_name is None


def test_release_and_resume_memory(engines, names, tmp_path):
    url = engines.urls[0]

    async def released(client):
        await client.release_memory_occupation()
        with pytest.raises(EngineError, match="503") as refused:
            await client.generate([[5, 6]], {"max_new_tokens": 2})
        assert "memory released" in refused.value.message and "weights" in refused.value.message
        assert not await client.health_generate()
        with pytest.raises(EngineError, match="already released"):
            await client.release_memory_occupation(["weights"])
        with pytest.raises(EngineError, match="weights are released"):
            await client.update_weights_from_tensor(_weights(engines.model_dir, 0)[:1], 10_000, last_bucket=True)
        await client.resume_memory_occupation(["kv_cache", "cuda_graph"])
        with pytest.raises(EngineError, match="\\(weights\\): call /resume_memory_occupation"):
            await client.generate([[5, 6]], {"max_new_tokens": 2})
        await client.resume_memory_occupation(["weights"])
        with pytest.raises(EngineError, match="resumed as zeros"):
            await client.generate([[5, 6]], {"max_new_tokens": 2})
        with pytest.raises(EngineError, match="not released"):
            await client.resume_memory_occupation(["weights"])
        return [torch.tensor(await client.get_weights_by_name(name, WHOLE)) for name in names]

    after_resume = _run(_each([url], released))[0]
    assert all(bool((values == 0).all()) for values in after_resume)  # new storage, not the old weights
    named = _weights(engines.model_dir, seed=50)
    version = max(_versions(engines.urls)) + 1
    with WeightSender([url], "tensor", api_key=KEY, timeout_s=30, scratch_dir=str(tmp_path)) as sender:
        sender.send(_buckets(named), version)
    replies = _run(_each([url], lambda client: client.generate([[5, 6]], {"max_new_tokens": 2, "temperature": 0})))
    assert replies[0][0]["meta_info"]["weight_version"] == str(version)
    _assert_bitwise(_served([url], names)[url], named)


def test_release_needs_an_idle_engine(engines):
    url = engines.urls[0]

    async def scenario(client):
        await client.pause_generation("in_place")
        held = asyncio.create_task(client.generate([[5, 6]], {"max_new_tokens": 2}))
        for _ in range(400):  # the request is held at the server
            if await asyncio.to_thread(_in_flight, url) >= 1:
                break
            await asyncio.sleep(0.025)
        with pytest.raises(EngineError, match="needs an idle engine"):
            await client.release_memory_occupation()
        await client.continue_generation()
        return await held

    reply = _run(_each([url], scenario))[0]
    assert len(reply[0]["output_ids"]) == 2


def _in_flight(url: str) -> float:
    text = httpx.get(f"{url}/metrics", headers=AUTH, timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.split("{")[0].split(" ")[0] == "rl360_http_requests_in_flight")


SENDER_WITH_DEFAULT_GROUP = textwrap.dedent("""
    import json, os, sys
    import torch.distributed as dist
    from safetensors.torch import load_file
    from rl360.weight_sync.sender import WeightSender

    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
    weights = sorted(load_file(sys.argv[2]).items())
    with WeightSender(sys.argv[3].split(","), "distributed", api_key=os.environ["KEY"], timeout_s=30) as sender:
        metrics = sender.send([weights[:7], weights[7:]], int(sys.argv[4]))
    dist.barrier()  # the default group is untouched
    dist.destroy_process_group()
    print(json.dumps(metrics))
""")


def test_distributed_send_from_a_process_with_a_default_group(engines, names, tmp_path):
    named = _weights(engines.model_dir, seed=60)
    save_file(dict(named), str(tmp_path / "weights.safetensors"))
    version = max(_versions(engines.urls)) + 1
    done = subprocess.run([sys.executable, "-c", SENDER_WITH_DEFAULT_GROUP, str(tmp_path / "store"),
                           str(tmp_path / "weights.safetensors"), ",".join(engines.urls), str(version)],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "KEY": KEY})
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["weight_sync/tensors"] == len(named)
    assert _versions(engines.urls) == [version, version]
    for served in _served(engines.urls, names).values():
        _assert_bitwise(served, named)


def test_shared_memory_files_round_trip_and_stay_confined(tmp_path):
    named = [("a", torch.arange(6, dtype=torch.float32).reshape(2, 3)), ("b", torch.ones(5, dtype=torch.bfloat16)),
             ("c", torch.zeros(0, dtype=torch.float16))]
    path, entry, size = write_shared_bucket(named, str(tmp_path))
    assert size == 128 and os.stat(path).st_mode & 0o077 == 0  # aligned offsets; readable by its owner only
    back = read_shared_bucket(entry)
    assert [name for name, _ in back] == ["a", "b", "c"]
    for (_, sent), (_, got) in zip(named, back):
        assert got.dtype == sent.dtype and torch.equal(got, sent)
    descriptor = json.loads(base64.b64decode(entry))
    link = tmp_path / "rl360-weights-link.bin"
    link.symlink_to(path)
    for bad_path, problem in ((str(tmp_path / "weights.bin"), "must be an absolute path to a rl360-weights-"),
                              (str(link), "cannot open")):
        bad = base64.b64encode(json.dumps({**descriptor, "path": bad_path}).encode()).decode()
        with pytest.raises(ValueError, match=problem):
            read_shared_bucket(bad)
    short = base64.b64encode(json.dumps({**descriptor, "bytes": 8}).encode()).decode()
    with pytest.raises(ValueError, match="offset"):
        read_shared_bucket(short)


def test_views_and_tied_weights_serialize_as_their_values(tmp_path):
    fused = torch.randn(6, 4)
    named = [("embed", fused), ("lm_head", fused), ("q", fused[:2]), ("k", fused[2:4]), ("t", fused.t()),
             ("empty", torch.zeros(0))]
    path, entry, _ = write_shared_bucket(named, str(tmp_path))
    for back in (dict(decode_tensor_bucket(encode_tensor_bucket(named))), dict(read_shared_bucket(entry))):
        for name, tensor in named:
            assert torch.equal(back[name], tensor), name
    os.unlink(path)
    with pytest.raises(ValueError, match="cannot open"):  # gone once the sender removed it
        read_shared_bucket(entry)


@pytest.mark.parametrize("route, body, param", [
    ("/init_weights_update_group", {"master_port": 1, "rank_offset": 1, "world_size": 2}, "master_address"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 2,
                                    "world_size": 2, "backend": "gloo"}, "rank_offset"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                    "world_size": 2, "backend": "mpi"}, "backend"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                    "world_size": 2}, "backend"),  # SGLang's default nccl, on a CPU engine
    ("/update_weights_from_distributed", {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]],
                                          "group_name": "no-such-group"}, "group_name"),
    ("/update_weights_from_tensor", {"serialized_named_tensors": [base64.b64encode(json.dumps(
        {"path": "/etc/passwd", "bytes": 4, "tensors": [{"name": "x", "dtype": "float32", "shape": [1],
                                                         "offset": 0}]}).encode()).decode()],
        "load_format": SHARED_MEMORY_LOAD_FORMAT}, "serialized_named_tensors"),
    ("/release_memory_occupation", {"tags": ["gpu"]}, "tags"),
    ("/resume_memory_occupation", {"tags": "weights"}, "tags"),
    ("/get_weights_by_name", {"name": "no.such.weight"}, "name"),
    ("/update_weights_from_disk", {"model_path": "/"}, "model_path"),  # no safetensors files there
])
def test_bad_requests_name_the_field(engines, route, body, param):
    reply = httpx.post(f"{engines.urls[0]}{route}", json=body, headers=AUTH, timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


def test_sender_checks_its_arguments_before_sending(tmp_path):
    for kwargs, problem in (({"strategy": "nfs"}, "strategy"), ({"strategy": "tensor", "backend": "mpi"}, "backend"),
                            ({"strategy": "disk", "scratch_dir": str(tmp_path / "absent")}, "scratch_dir")):
        with pytest.raises(ConfigError, match=problem):
            WeightSender(["http://127.0.0.1:9"], **kwargs)
    with pytest.raises(ConfigError, match="twice"):
        WeightSender(["http://127.0.0.1:9", "http://127.0.0.1:9/"], "tensor")
    with WeightSender(["http://127.0.0.1:9"], "tensor", scratch_dir=str(tmp_path)) as sender:
        for buckets, problem in (([], "at least one bucket"), ([[("w", torch.zeros(2, dtype=torch.int64))]], "int64"),
                                 ([[("w", torch.zeros(2)), ("w", torch.ones(2))]], "sent twice"),
                                 ([[]], "non-empty list")):
            with pytest.raises(ValueError, match=problem):
                sender.send(buckets, 1)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RuntimeError, match="closed"):
        sender.send([[("w", torch.zeros(2))]], 1)


def test_tied_weights_load_and_read_under_either_name(tmp_path):
    """In process (the service's ASGI app): a tied checkpoint takes its shared weight as lm_head.weight and is
    read back under both names."""
    from rl360.engine.server import RolloutService

    model_dir = make_tiny_qwen2(str(tmp_path / "tied"), tie_word_embeddings=True, seed=8)
    service = RolloutService(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    named = [(name, param.detach() + 1.0) for name, param in model.named_parameters()]
    named = [("lm_head.weight" if name == "model.embed_tokens.weight" else name, tensor) for name, tensor in named]

    async def scenario():
        async with EngineClient("http://tied.invalid", timeout_s=30) as client:
            client._http = httpx.AsyncClient(base_url=client.url, transport=httpx.ASGITransport(app=service.guard))
            await client.update_weights_from_tensor(named, 1, last_bucket=True)
            return [await client.get_weights_by_name(name, WHOLE) for name in
                    ("lm_head.weight", "model.embed_tokens.weight")]

    head, embed = _run(scenario())
    shared = dict(named)["lm_head.weight"]
    assert torch.equal(torch.tensor(head), shared) and torch.equal(torch.tensor(embed), shared)


def test_a_registered_strategy_is_a_config_value_the_sender_builds():
    """A strategy registers itself in its own module (here, this test): it becomes a `rollout.weight_sync` value,
    its engine facts are checked, and the sender builds and runs it; nothing else lists it."""
    from rl360.config import load_config
    from rl360.weight_sync.registry import get_strategy, register_strategy, strategy_names, unregister_strategy

    sent = []

    @register_strategy("in_test", summary="buckets kept in a list", engines=("server",), same_host=True)
    class ListSync:
        def __init__(self, calls, scratch_dir):
            self.calls, self.scratch_dir = calls, scratch_dir

        @classmethod
        def from_options(cls, calls, options):
            return cls(calls, options.scratch_dir)

        def send(self, stream, version):
            sent.extend((version, [name for name, _ in bucket], last) for bucket, last in stream)

        def reset(self):
            sent.append("reset")

    base = ["model.path=m", "data.train_files=[d.parquet]", "rollout.engine=server"]
    try:
        assert "in_test" in strategy_names() and get_strategy("in_test").cls is ListSync
        assert load_config(None, base + ["rollout.weight_sync=in_test"]).rollout.weight_sync == "in_test"
        with pytest.raises(ConfigError, match="rollout.weight_sync=in_test does not reach these engines"):
            load_config(None, base[:2] + ["rollout.engine=sglang", "rollout.weight_sync=in_test"])
        with pytest.raises(ConfigError, match="engine_hosts=ray needs .* sync and colocation need"):
            load_config(None, base + ["rollout.weight_sync=in_test", "rollout.engine_hosts=ray"])
        with WeightSender(["http://127.0.0.1:9"], "in_test") as sender:
            metrics = sender.send([[("a", torch.zeros(2))], [("b", torch.ones(3))]], version=4)
        assert sent == ["reset", (4, ["a"], False), (4, ["b"], True), "reset"]
        assert metrics["weight_sync/buckets"] == 2 and metrics["weight_sync/tensors"] == 2
    finally:
        unregister_strategy("in_test")
    assert "in_test" not in strategy_names()
    with pytest.raises(ConfigError, match=r"rollout\.weight_sync='in_test' is not allowed"):
        load_config(None, base + ["rollout.weight_sync=in_test"])
