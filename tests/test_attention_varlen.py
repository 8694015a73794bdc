"""The packed (THD) core attention: when it takes torch's varlen flash-attention kernel, and (on a GPU) that one
varlen call gives what one SDPA call per sequence gives, values and gradients, grouped-query heads included."""

from __future__ import annotations

import types

import pytest
import torch

from megatron_bridge import attention
from megatron_bridge.attention import HostPackedSeqParams, TorchCoreAttention, sequence_bounds, use_varlen

CUDA = torch.device("cuda", 0)
needs_varlen_api = pytest.mark.skipif(attention._varlen_attn is None or attention._VARLEN_CAUSAL is None,
                                      reason="this torch has no torch.nn.attention.varlen")


@needs_varlen_api
def test_varlen_is_chosen_for_cuda_half_precision_and_flash_head_dims_only():
    assert use_varlen(CUDA, torch.bfloat16, 128, flash_capable=True)
    assert use_varlen(CUDA, torch.float16, 64, 64, flash_capable=True)
    assert use_varlen(CUDA, torch.bfloat16, 256, flash_capable=True)
    assert not use_varlen(CUDA, torch.float32, 128, flash_capable=True)  # flash kernels refuse fp32
    assert not use_varlen(torch.device("cpu"), torch.bfloat16, 128, flash_capable=True)
    assert not use_varlen(torch.device("cpu"), torch.float32, 128)
    assert not use_varlen(CUDA, torch.bfloat16, 100, flash_capable=True)  # not a multiple of 8
    assert not use_varlen(CUDA, torch.bfloat16, 264, flash_capable=True)  # above the kernels' 256
    assert not use_varlen(CUDA, torch.bfloat16, 128, 64, flash_capable=True)  # values of another head dim
    assert not use_varlen(CUDA, torch.bfloat16, 128, flash_capable=False)  # e.g. a pre-Ampere GPU


def test_varlen_signature_is_read_once():
    if attention._varlen_attn is None:
        assert not use_varlen(CUDA, torch.bfloat16, 128, flash_capable=True)
        return
    import inspect

    parameters = inspect.signature(attention._varlen_attn).parameters
    assert attention._VARLEN_GQA == ("enable_gqa" in parameters)
    assert attention._VARLEN_CAUSAL == ({"window_size": (-1, 0)} if "window_size" in parameters else
                                        {"is_causal": True} if "is_causal" in parameters else None)


def test_sequence_bounds_come_from_the_host_copy_when_there_is_one():
    on_device = HostPackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.empty(3, device="meta"),
                                    max_seqlen_q=3, host_bounds=(0, 3, 5))
    assert sequence_bounds(on_device) == [0, 3, 5]  # the meta tensor has no values: never read
    plain = HostPackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 2, 7], dtype=torch.int32))
    assert sequence_bounds(plain) == [0, 2, 7]


def _packed_inputs(lengths, heads, kv_heads, head_dim, dtype, device, seed=0):
    generator = torch.Generator(device=device).manual_seed(seed)
    total = sum(lengths)
    q, k, v = (torch.randn(total, n, head_dim, generator=generator, device=device, dtype=torch.float32).to(dtype)
               .requires_grad_() for n in (heads, kv_heads, kv_heads))
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length)
    params = HostPackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor(bounds, dtype=torch.int32, device=device),
                                 cu_seqlens_kv=torch.tensor(bounds, dtype=torch.int32, device=device),
                                 max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths), host_bounds=tuple(bounds))
    return q, k, v, params


def _per_sequence(core, q, k, v, bounds):
    parts = [TorchCoreAttention._attend(core, q[a:b, None], k[a:b, None], v[a:b, None], None)
             for a, b in zip(bounds, bounds[1:])]
    return torch.cat(parts, dim=0).reshape(q.shape[0], -1)


def _outputs_and_grads(fn, q, k, v, seed=1):
    out = fn(q, k, v)
    upstream = torch.randn(out.shape, generator=torch.Generator(device=out.device).manual_seed(seed),
                           device=out.device, dtype=torch.float32).to(out.dtype)
    grads = torch.autograd.grad(out, (q, k, v), upstream)
    return [out, *grads]


def _assert_within_bf16_resolution(ours, reference, ulps=4):
    """|ours - reference| at most `ulps` bf16 steps (2^-8 relative) of the reference's largest magnitude."""
    for name, a, b in zip(("output", "dq", "dk", "dv"), ours, reference):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        scale = b.float().abs().max().item()
        error = (a.float() - b.float()).abs().max().item()
        assert error <= ulps * 2.0 ** -8 * scale, (name, error, scale)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(12, 2, 128), (8, 8, 64), (4, 1, 128)])
@pytest.mark.parametrize("gqa_argument", [True, False], ids=["enable_gqa", "expanded"])
def test_varlen_matches_per_sequence_sdpa_on_cuda_bf16(monkeypatch, heads, kv_heads, head_dim, gqa_argument):
    if not gqa_argument:  # the path of a torch whose varlen_attn has no enable_gqa: heads expanded
        monkeypatch.setattr(attention, "_VARLEN_GQA", False)
    elif not attention._VARLEN_GQA:
        pytest.skip("this torch's varlen_attn has no enable_gqa")
    device = torch.device("cuda", torch.cuda.current_device())
    assert use_varlen(device, torch.bfloat16, head_dim, head_dim), "the varlen path must run on this GPU"
    core = types.SimpleNamespace(softmax_scale=head_dim ** -0.5 * 0.9)  # a scale that is not SDPA's default
    lengths = [1, 37, 256, 1, 129, 8, 600]  # length 1, odd lengths, one longer than a flash block
    q, k, v, params = _packed_inputs(lengths, heads, kv_heads, head_dim, torch.bfloat16, device)
    ours = _outputs_and_grads(lambda *x: TorchCoreAttention._varlen(core, *x, params), q, k, v)
    reference = _outputs_and_grads(lambda *x: _per_sequence(core, *x, list(params.host_bounds)), q, k, v)
    _assert_within_bf16_resolution(ours, reference)
    # the first token of every sequence sees only itself: its output is its own value, whatever came before
    group = heads // kv_heads
    for start in params.host_bounds[:-1]:
        own = v[start].repeat_interleave(group, dim=0).reshape(-1)
        assert torch.allclose(ours[0][start].float(), own.float(), atol=2.0 ** -7 * own.float().abs().max().item())
