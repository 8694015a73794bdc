"""The CUDA IPC weight format ("rl360_cuda_ipc") and the `tensor` sender's choice of format.

On CPU: the flat bucket layout packs and unpacks every weight dtype bit for bit; the descriptor round-trips and
every malformed field is refused by name; a CPU engine refuses a CUDA IPC bucket (400, old weights kept); the
sender sends CPU buckets through shared memory. On a GPU (marked `gpu`): `rl360 serve rollout` processes on the
sender's GPU receive float32 and bfloat16 updates bit for bit through CUDA IPC (never shared memory), refused
updates leave the old weights and version, the sender's buffers are freed after every update, refused or not,
and a descriptor naming another GPU is refused by name."""

import asyncio
import base64
import json
import os
import subprocess
import sys

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from rl360.config import ConfigError, load_config
from rl360.core.client import EngineClient, EngineError
from rl360.weight_sync import tensor as tensor_sync
from rl360.weight_sync.cuda_ipc import (
    CUDA_ALIGNMENT,
    CUDA_IPC_LOAD_FORMAT,
    CudaIpcPacker,
    decode_descriptor,
    encode_descriptor,
    open_bucket,
)
from rl360.weight_sync.flat_bucket import layout, pack, unpack
from rl360.weight_sync.formats import SHARED_MEMORY_LOAD_FORMAT, read_shared_bucket
from rl360.weight_sync.sender import WeightSender
from tests.helpers import make_tiny_qwen2, serving_url

KEY = "cuda-ipc-test-key-0123456789"
WHOLE = 1 << 30
GPU = {"uuid": "5f1b2c3d-0000-1111-2222-333344445555", "pci_bus_id": "0000:19:00.0", "name": "NVIDIA H100"}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _mixed_bucket() -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    fused = torch.randn(6, 4, generator=generator)
    return [("a", torch.randn(3, 5, generator=generator)),
            ("b", torch.randn(7, generator=generator).to(torch.bfloat16)),
            ("c", torch.randn(2, 3, generator=generator).to(torch.float16)),
            ("d", torch.randn(3, generator=generator).double()),
            ("q", fused[:2]), ("t", fused.t()),  # a view, and a non-contiguous tensor
            ("empty", torch.zeros(0, 4)), ("scalar", torch.tensor(2.5))]


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).contiguous().view(torch.uint8)


def test_the_flat_layout_packs_and_unpacks_every_dtype_bit_for_bit():
    bucket = _mixed_bucket()
    specs, size = layout(bucket, CUDA_ALIGNMENT)
    assert [spec["offset"] % CUDA_ALIGNMENT for spec in specs] == [0] * len(bucket)
    assert [spec["dtype"] for spec in specs[:4]] == ["float32", "bfloat16", "float16", "float64"]
    assert size == specs[-1]["offset"] + 4
    flat = torch.full((size + 100,), 0xAB, dtype=torch.uint8)
    pack(bucket, specs, flat)
    back = unpack(flat, specs)
    assert [name for name, _ in back] == [name for name, _ in bucket]
    for (_, sent), (_, got) in zip(bucket, back):
        assert got.dtype == sent.dtype and got.shape == sent.shape
        assert torch.equal(_bits(got), _bits(sent))
    flat.zero_()  # the unpacked tensors own their memory
    assert torch.equal(back[0][1], bucket[0][1])
    with pytest.raises(ValueError, match="twice"):
        layout([("w", torch.zeros(1)), ("w", torch.zeros(1))], CUDA_ALIGNMENT)
    with pytest.raises(ValueError, match="int64"):
        layout([("w", torch.zeros(1, dtype=torch.int64))], CUDA_ALIGNMENT)


def _entry(**changes) -> str:
    """A well-formed descriptor entry (a made-up buffer), with top-level fields or `ipc.*` / `device.*` changed."""
    specs, size = layout([("w", torch.zeros(3, 4)), ("b", torch.zeros(5, dtype=torch.bfloat16))], CUDA_ALIGNMENT)
    ipc = {"handle": bytes(range(64)), "storage_bytes": 4 << 20, "storage_offset": 512,
           "ref_counter": b"/torch_4242_123456_0", "ref_counter_offset": 7}
    descriptor = json.loads(base64.b64decode(encode_descriptor(dict(GPU), ipc, size, specs)))
    for key, value in changes.items():
        where, _, field = key.rpartition("__")
        target = descriptor[where] if where else descriptor
        if value is ...:
            del target[field]
        else:
            target[field] = value
    return base64.b64encode(json.dumps(descriptor).encode()).decode()


def test_the_descriptor_round_trips():
    descriptor = decode_descriptor(_entry())
    assert descriptor["device"] == GPU
    assert descriptor["ipc"] == {"handle": bytes(range(64)), "storage_bytes": 4 << 20, "storage_offset": 512,
                                 "ref_counter": b"/torch_4242_123456_0", "ref_counter_offset": 7}
    assert descriptor["bytes"] == 256 + 10
    assert descriptor["tensors"] == [{"name": "w", "dtype": "float32", "shape": [3, 4], "offset": 0},
                                     {"name": "b", "dtype": "bfloat16", "shape": [5], "offset": 256}]
    assert decode_descriptor(_entry(device__pci_bus_id=None))["device"]["pci_bus_id"] is None


def _spec(**changes) -> list[dict]:
    return [{"name": "w", "dtype": "float32", "shape": [3, 4], "offset": 0, **changes}]


@pytest.mark.parametrize("entry, problem", [
    (7, "entries must be base64 strings"),
    ("not base64!", "not base64 of a JSON descriptor"),
    (base64.b64encode(b"[1, 2]").decode(), "exactly 'device', 'ipc', 'bytes' and 'tensors'"),
    (_entry(ipc=...), "exactly 'device', 'ipc', 'bytes' and 'tensors'"),
    (_entry(extra=1), "exactly 'device', 'ipc', 'bytes' and 'tensors'"),
    (_entry(device__uuid=""), "'device.uuid' must be a non-empty string"),
    (_entry(device__name=...), "'device' must be an object with exactly"),
    (_entry(device__pci_bus_id=19), "'device.pci_bus_id' must be a string or null"),
    (_entry(ipc__event="AAAA"), "'ipc' must be an object with exactly"),
    (_entry(ipc__handle="!!!!"), "'ipc.handle' is not base64"),
    (_entry(ipc__handle=""), "'ipc.handle' must be a non-empty base64 string"),
    (_entry(ipc__handle=base64.b64encode(bytes(5000)).decode()), "'ipc.handle' holds 5000 bytes"),
    (_entry(ipc__storage_bytes=-1), "'ipc.storage_bytes' must be a non-negative integer"),
    (_entry(ipc__storage_bytes=True), "'ipc.storage_bytes' must be a non-negative integer"),
    (_entry(ipc__storage_bytes=0), "'ipc.storage_bytes' must be positive"),
    (_entry(ipc__storage_offset="512"), "'ipc.storage_offset' must be a non-negative integer"),
    (_entry(ipc__ref_counter_offset=10000), "'ipc.ref_counter_offset' must be below 10000"),
    (_entry(ipc__ref_counter=base64.b64encode(b"/etc/passwd").decode()), "'ipc.ref_counter' must name one of"),
    (_entry(ipc__ref_counter=base64.b64encode(b"/torch_1/../x").decode()), "'ipc.ref_counter' must name one of"),
    (_entry(bytes=(4 << 20) + 1), "'bytes' must be a non-negative integer within 'ipc.storage_bytes'"),
    (_entry(bytes=-3), "'bytes' must be a non-negative integer within"),
    (_entry(tensors=[]), "'tensors' must be a non-empty list"),
    (_entry(tensors=_spec(dtype="int8")), r"tensors\[0\]\.dtype must be one of"),
    (_entry(tensors=_spec(dtype="torch.float32")), r"tensors\[0\]\.dtype must be one of"),
    (_entry(tensors=_spec(shape=[3, -4])), r"tensors\[0\]\.shape must be a list of non-negative integers"),
    (_entry(tensors=_spec(offset=256)), r"tensors\[0\]\.offset must be a multiple of 4 with the tensor inside"),
    (_entry(tensors=_spec(offset=2)), r"tensors\[0\]\.offset must be a multiple of 4"),
    (_entry(tensors=_spec(offset=-4)), r"tensors\[0\]\.offset must be a multiple of 4"),
    (_entry(tensors=[{"name": "w", "dtype": "float32", "shape": [1]}]), r"tensors\[0\] must be an object"),
    (_entry(tensors=_spec() + _spec(offset=48)), "names a weight twice"),
])
def test_a_malformed_descriptor_is_refused_by_name(entry, problem):
    with pytest.raises(ValueError, match=problem):
        decode_descriptor(entry)
    with pytest.raises(ValueError, match=problem):  # before anything touches CUDA
        open_bucket(entry, torch.device("cpu"))


def test_a_cpu_engine_refuses_a_cuda_ipc_bucket_and_keeps_its_weights(tmp_path):
    with pytest.raises(ValueError, match=f"runs on cpu, and the weights are on GPU {GPU['uuid']} .*sender's GPU"):
        open_bucket(_entry(), torch.device("cpu"))
    from rl360.engine.server import RolloutService

    service = RolloutService(make_tiny_qwen2(str(tmp_path / "model"), tie_word_embeddings=False, seed=2))
    before = {name: param.detach().clone() for name, param in service.engine.model.named_parameters()}

    async def scenario():
        async with httpx.AsyncClient(base_url="http://engine.invalid",
                                     transport=httpx.ASGITransport(app=service.guard)) as http:
            return await http.post("/update_weights_from_tensor", json={
                "serialized_named_tensors": [_entry()], "load_format": CUDA_IPC_LOAD_FORMAT, "weight_version": "5"})

    reply = asyncio.run(scenario())
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "serialized_named_tensors" and "sender's GPU" in error["message"]
    assert service.engine.version == 0
    for name, param in service.engine.model.named_parameters():
        assert torch.equal(param, before[name]), name


def test_the_sender_sends_cpu_buckets_through_shared_memory(tmp_path):
    seen = []

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        # the file exists while the engine is asked
        seen.append((body["load_format"], body["flush_cache"], read_shared_bucket(body["serialized_named_tensors"][0])))
        return httpx.Response(200, json={"success": True, "message": "ok"})

    buckets = [[("w", torch.randn(3, 2)), ("v", torch.ones(4, dtype=torch.bfloat16))], [("u", torch.arange(3.0))]]
    with WeightSender(["http://engine.invalid"], "tensor", scratch_dir=str(tmp_path)) as sender:
        client = sender.calls.clients["http://engine.invalid"]
        client._http = httpx.AsyncClient(base_url=client.url, transport=httpx.MockTransport(answer))
        metrics = sender.send(buckets, 3)
    assert metrics["weight_sync/buckets"] == 2 and metrics["weight_sync/tensors"] == 3
    assert [(fmt, last) for fmt, last, _ in seen] == [(SHARED_MEMORY_LOAD_FORMAT, False),
                                                      (SHARED_MEMORY_LOAD_FORMAT, True)]
    for bucket, (_, _, received) in zip(buckets, seen):
        assert [name for name, _ in received] == [name for name, _ in bucket]
        assert all(torch.equal(got, sent) for (_, got), (_, sent) in zip(received, bucket))
    assert list(tmp_path.iterdir()) == []


def test_sglang_engines_are_not_sent_rl360_tensor_formats():
    base = ["model.path=/m", "data.train_files=[d.parquet]", "rollout.engine=sglang"]
    with pytest.raises(ConfigError, match="rollout.weight_sync=tensor .* rollout.weight_sync=disk or distributed"):
        load_config(None, base + ["rollout.weight_sync=tensor"])
    assert load_config(None, base + ["rollout.weight_sync=disk"]).rollout.weight_sync == "disk"


# ---- on a GPU: `rl360 serve rollout` processes on the sender's GPU ----
def _launch(model_dir: str, dtype: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "rl360.cli", "serve", "rollout", "--model", model_dir, "--port",
                             "0", "--api-key-env", "RL360_TEST_ROLLOUT_KEY", "--batch-window-ms", "1", "--dtype", dtype,
                             "--shutdown-grace", "5"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "RL360_TEST_ROLLOUT_KEY": KEY, "OMP_NUM_THREADS": "1"})
    return proc, serving_url(proc)


@pytest.fixture(scope="module")
def gpu_engines(tmp_path_factory):
    """One engine per dtype on this process's GPU: {"float32": url, "bfloat16": url}, and the model's directory."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model_dir = make_tiny_qwen2(str(tmp_path_factory.mktemp("cuda_ipc") / "model"), tie_word_embeddings=False, seed=4)
    launched = {dtype: _launch(model_dir, dtype) for dtype in ("float32", "bfloat16")}
    yield {dtype: url for dtype, (_, url) in launched.items()}, model_dir
    for proc, _ in launched.values():
        proc.terminate()
    for proc, _ in launched.values():
        proc.communicate(timeout=30)


def _gpu_weights(model_dir: str, seed: int, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    generator = torch.Generator().manual_seed(seed)
    return [(name, (param.detach() + 0.05 * torch.randn(param.shape, generator=generator)).to("cuda", dtype))
            for name, param in model.named_parameters()]


def _call(url: str, fn):
    async def run():
        async with EngineClient(url, api_key=KEY, timeout_s=60) as client:
            return await fn(client)
    return asyncio.run(run())


def _served(url: str, names: list[str]) -> dict[str, torch.Tensor]:
    async def read(client):
        return {name: torch.tensor(await client.get_weights_by_name(name, WHOLE), dtype=torch.float32)
                for name in names}
    return _call(url, read)


def _version(url: str) -> int:
    return int(_call(url, lambda client: client.weight_version()))


def _assert_bitwise(served: dict[str, torch.Tensor], named: list[tuple[str, torch.Tensor]]) -> None:
    assert set(served) == {name for name, _ in named}
    for name, tensor in named:
        sent = tensor.detach().float().cpu()  # bfloat16 -> float32 is exact, as the engine's read-back is
        assert served[name].shape == sent.shape, name
        assert torch.equal(served[name].view(torch.int32), sent.view(torch.int32)), f"{name} differs"


def _buckets(named: list, count: int = 5) -> list[list]:
    size = -(-len(named) // count)
    return [named[i:i + size] for i in range(0, len(named), size)]


@pytest.fixture
def no_host_path(monkeypatch):
    """The shared-memory path fails if taken: CUDA buckets must go by CUDA IPC."""
    def refuse(*_):
        raise AssertionError("a CUDA bucket went through shared memory")
    monkeypatch.setattr(tensor_sync, "write_shared_bucket", refuse)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_engine_on_this_gpu_receives_an_update_bit_for_bit(gpu_engines, dtype, no_host_path, tmp_path):
    urls, model_dir = gpu_engines
    url = urls[str(dtype).removeprefix("torch.")]
    named = _gpu_weights(model_dir, seed=1, dtype=dtype)
    version = _version(url) + 1
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    with WeightSender([url], "tensor", api_key=KEY, timeout_s=60, scratch_dir=str(tmp_path)) as sender:
        metrics = sender.send(_buckets(named), version)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == allocated  # both buffers freed
    assert metrics["weight_sync/buckets"] == 5 and metrics["weight_sync/bytes"] == sum(
        t.numel() * t.element_size() for _, t in named)
    assert _version(url) == version
    _assert_bitwise(_served(url, [name for name, _ in named]), named)


@pytest.mark.gpu
@needs_cuda
def test_a_refused_update_leaves_the_old_weights_and_frees_the_buffers(gpu_engines, no_host_path, tmp_path):
    urls, model_dir = gpu_engines
    url = urls["float32"]
    names = [name for name, _ in _gpu_weights(model_dir, seed=0, dtype=torch.float32)]
    old = _gpu_weights(model_dir, seed=2, dtype=torch.float32)
    version = _version(url) + 1
    with WeightSender([url], "tensor", api_key=KEY, timeout_s=60, scratch_dir=str(tmp_path)) as sender:
        sender.send(_buckets(old), version)
        new = _gpu_weights(model_dir, seed=3, dtype=torch.float32)
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
        refusals = [
            (_buckets([pair for pair in new if pair[0] != names[3]]), version + 1, "left parameters unset"),
            (_buckets(new[:4] + [("model.no_such.weight", torch.zeros(2, device="cuda"))] + new[4:]), version + 1,
             "no_such"),
            (_buckets(new), version - 1, "older than the served version"),
        ]
        for buckets, sent_version, problem in refusals:
            with pytest.raises(EngineError, match=problem) as refused:
                sender.send(buckets, sent_version)
            assert url in str(refused.value)
            torch.cuda.synchronize()
            assert torch.cuda.memory_allocated() == allocated, problem  # refused, and still freed
            assert _version(url) == version
            _assert_bitwise(_served(url, names), old)
        sender.send(_buckets(new), version + 1)  # the same sender goes on
    assert _version(url) == version + 1
    _assert_bitwise(_served(url, names), new)


@pytest.mark.gpu
@needs_cuda
def test_a_buffer_on_another_gpu_is_refused_by_name(gpu_engines):
    urls, _ = gpu_engines
    url = urls["float32"]
    version = _version(url)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    packer = CudaIpcPacker()
    packed = packer.pack([("model.norm.weight", torch.ones(64, device="cuda"))])
    entry, counter = packer.share(packed)
    descriptor = json.loads(base64.b64decode(entry))
    descriptor["device"]["uuid"] = "00000000-0000-0000-0000-000000000000"
    reply = httpx.post(f"{url}/update_weights_from_tensor", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                       json={"serialized_named_tensors": [base64.b64encode(json.dumps(descriptor).encode()).decode()],
                             "load_format": CUDA_IPC_LOAD_FORMAT, "weight_version": str(version + 1)})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "serialized_named_tensors"
    assert "00000000-0000-0000-0000-000000000000 is not visible to this engine" in reply.json()["error"]["message"]
    packer.release(counter)  # the engine never opened it
    del packed
    packer.close()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == allocated
    assert _version(url) == version
