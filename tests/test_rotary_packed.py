"""`megatron_bridge.rotary`: RoPE on packed rows from per-token angles, with nothing read back from the device."""

from __future__ import annotations

import contextlib

import pytest
import torch

from megatron_bridge.attention import HostPackedSeqParams


@contextlib.contextmanager
def _no_reads_from_tensors():
    """`Tensor.tolist` and `Tensor.item` raise while inside (what would wait for a GPU to read bounds back)."""
    def refuse(name):
        def call(self, *args, **kwargs):
            raise AssertionError(f"Tensor.{name}() on a {tuple(self.shape)} {self.dtype} tensor inside the model")
        return call

    saved = torch.Tensor.tolist, torch.Tensor.item
    torch.Tensor.tolist, torch.Tensor.item = refuse("tolist"), refuse("item")
    try:
        yield
    finally:
        torch.Tensor.tolist, torch.Tensor.item = saved


def _packed(lengths, bounds_device="cpu"):
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length)
    starts = torch.tensor(bounds, dtype=torch.int32, device=bounds_device)
    positions = torch.cat([torch.arange(length) for length in lengths])[None]
    return HostPackedSeqParams(qkv_format="thd", cu_seqlens_q=starts, cu_seqlens_kv=starts,
                               max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths),
                               host_bounds=tuple(bounds)), positions


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.helpers import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("hf")), "qwen2", tie_word_embeddings=False, num_layers=2)


@pytest.mark.parametrize("attention", ["torch", "local"])
def test_the_bridges_specs_rotate_packed_rows_per_token(megatron_single_rank, tiny, attention):
    from megatron_bridge import Bridge
    from megatron_bridge.rotary import TokenRotarySelfAttention

    model = Bridge.from_hf_pretrained(tiny).to_megatron_model(load_weights=False, attention=attention)[0]
    assert type(model).__name__ == "TokenRotaryGPTModel"
    assert all(isinstance(layer.self_attention, TokenRotarySelfAttention) for layer in model.decoder.layers)


def test_packed_forward_reads_nothing_back_and_matches_each_sequence_alone(megatron_single_rank, tiny):
    """The packed row's logits are each sequence's own (1e-5) while `tolist` / `item` refuse to run and the
    sequence bounds live on the meta device: RoPE takes neither the bounds nor reads the positions back."""
    from megatron_bridge import Bridge

    model = Bridge.from_hf_pretrained(tiny).to_megatron_model(load_weights=True, attention="torch")[0].eval()
    lengths = [5, 9, 3]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 99, (1, sum(lengths)), generator=generator)
    packing, positions = _packed(lengths, bounds_device="meta")
    with torch.no_grad():
        with _no_reads_from_tensors():
            packed = model(ids, positions, None, packed_seq_params=packing)
        alone = [model(part, torch.arange(part.shape[1])[None], None)
                 for part in ids.split(lengths, dim=1)]
    torch.testing.assert_close(packed, torch.cat(alone, dim=1), rtol=0, atol=1e-5)


def test_packed_gradients_match_each_sequence_alone(megatron_single_rank, tiny):
    from megatron_bridge import Bridge

    model = Bridge.from_hf_pretrained(tiny).to_megatron_model(load_weights=True, attention="torch")[0]
    lengths = [4, 7]
    ids = torch.randint(0, 99, (1, sum(lengths)), generator=torch.Generator().manual_seed(1))
    packing, positions = _packed(lengths)

    def gradients(loss):
        model.zero_grad(set_to_none=True)
        loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    with _no_reads_from_tensors():
        logits = model(ids, positions, None, packed_seq_params=packing).float()
    packed = gradients(logits.square().mean())
    alone_loss = sum(model(part, torch.arange(part.shape[1])[None], None).float().square().sum()
                     for part in ids.split(lengths, dim=1)) / logits.numel()
    alone = gradients(alone_loss)
    assert packed.keys() == alone.keys()
    for name in packed:
        torch.testing.assert_close(packed[name], alone[name], rtol=0, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_a_packed_row_refuses_an_angle_table_that_is_not_per_token(megatron_single_rank, tiny):
    """Built as a plain `GPTModel` (megatron's table of positions 0..longest-1 for the whole row), the layers
    say so rather than rotating with the wrong rows."""
    from megatron.core.models.gpt import GPTModel

    from megatron_bridge import Bridge

    model = Bridge.from_hf_pretrained(tiny).to_megatron_model(load_weights=False, attention="torch")[0]
    model._preprocess = GPTModel._preprocess.__get__(model)  # megatron's, without the per-token gather
    packing, positions = _packed([5, 9, 3])
    with torch.no_grad(), pytest.raises(ValueError, match="rotary angles per token"):
        model(torch.zeros(1, 17, dtype=torch.long), positions, None, packed_seq_params=packing)
