"""The packing metadata a micro-batch hands to megatron is computed on the host: Python-int lengths, int32 bounds
with a host copy, response positions; the device copies are made from it and never read back."""

from __future__ import annotations

import types

import pytest
import torch

from megatron_bridge.attention import HostPackedSeqParams
from rl360.actor.batch import build_batch, to_device
from rl360.actor.policy import PolicyWorker
from rl360.actor.policy_update import reports_to_floats


def _batch():
    prompts, responses = [[5, 6, 7], [8], [9, 10]], [[11, 12], [13, 14, 15, 16], [17]]
    batch = build_batch(prompts, responses, [[-1.0] * len(r) for r in responses])
    batch.response_mask[1, 3] = 0.0  # the last token of row 1 not trained on: its sequence ends before it
    return batch


def test_packing_gives_host_ints_and_int32_bounds():
    row = _batch().packing(multiple=2)
    assert row.lengths == [6, 4, 4] and all(type(n) is int for n in row.lengths)  # 5, 4 (3 trained), 3 rounded up
    assert type(row.max_length) is int and row.max_length == 6
    assert row.cu_seqlens.dtype == torch.int32 and row.cu_seqlens.tolist() == [0, 6, 10, 14]
    assert row.input_ids.tolist() == [[5, 6, 7, 11, 12, 0, 8, 13, 14, 15, 9, 10, 17, 0]]
    assert row.positions.tolist() == [[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 0, 1, 2, 3]]
    assert torch.equal(row.response_positions, _batch().packed_response_positions(multiple=2))
    assert row.response_positions[:, 0].tolist() == [2, 6, 11]  # the logits predicting each first response token


@pytest.mark.parametrize("pack", [True, False])
def test_step_inputs_compute_everything_before_the_device(pack):
    """The device is `meta` (tensors with no values): anything computed from the device copies instead of the
    host's would fail to read them."""
    worker = types.SimpleNamespace(settings=types.SimpleNamespace(actor=types.SimpleNamespace(pack_sequences=pack)),
                                   device=torch.device("meta"), sequence_multiple=2, multimodal=None)
    host = _batch()
    mb, input_ids, positions, packing, lengths, vision = PolicyWorker._step_inputs(worker, host)
    assert input_ids.device.type == positions.device.type == mb.input_ids.device.type == "meta"
    assert vision == {}
    rows, response_positions = mb.logit_index
    assert rows.device.type == response_positions.device.type == "meta"
    if not pack:
        assert packing is None and lengths == [6] and input_ids.shape == (3, 6)
        return
    assert isinstance(packing, HostPackedSeqParams) and packing.qkv_format == "thd"
    assert type(packing.max_seqlen_q) is int and packing.max_seqlen_q == packing.max_seqlen_kv == 6
    assert packing.cu_seqlens_q.dtype == torch.int32 and packing.cu_seqlens_q.device.type == "meta"
    assert packing.host_bounds == (0, 6, 10, 14) and all(type(n) is int for n in packing.host_bounds)
    assert lengths == [6, 4, 4] and input_ids.shape == positions.shape == (1, 14)


def test_to_device_keeps_host_tensors_on_a_cpu_target():
    tensor = torch.arange(4)
    assert to_device(tensor, "cpu") is tensor


def test_reports_are_read_in_one_go_as_floats():
    reports = [{"a": torch.tensor(0.5), "b": 2}, {"a": torch.tensor(1.25, dtype=torch.float64), "b": torch.tensor(3)}]
    assert reports_to_floats(reports) == [{"a": 0.5, "b": 2.0}, {"a": 1.25, "b": 3.0}]
    assert reports_to_floats([]) == [] and reports_to_floats([{"x": 1}]) == [{"x": 1.0}]
