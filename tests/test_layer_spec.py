"""`megatron_bridge.layer_spec`: model.attention's resolution, its errors, and the local -> Transformer Engine names.

Without Transformer Engine the TE layer spec cannot be built here, so its parameter names are derived from
megatron's own spec functions: `get_gpt_decoder_block_spec(config, use_transformer_engine=True)` (which calls
`get_gpt_layer_with_transformer_engine_spec`) is run with stand-ins for `TESpecProvider` and `TENorm` that hand out
one marker class per TE module kind, and the ModuleSpec tree it returns is walked.
Each marker carries the parameter names its TE module registers, pinned from Transformer Engine 2.11 (the version
in launchers/versions.env): `pytorch/module/layernorm_linear.py` (`LayerNormLinear`: `layer_norm_weight`,
`layer_norm_bias` only for LayerNorm, `weight`, `bias` only when biased), `pytorch/module/linear.py` (`Linear`:
`weight`, `bias` only when biased), `pytorch/ops/basic/rmsnorm.py` (`RMSNorm`: `weight`) and
`pytorch/attention/dot_product_attention/dot_product_attention.py` (`DotProductAttention`: no parameters).
The GPU tests at the end build the real TE model (skipped without CUDA and transformer_engine).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_bridge import layer_spec as layer_spec_module
from megatron_bridge.arch import ARCHITECTURES
from megatron_bridge.layer_spec import (
    TE_NAMES,
    auto_reason,
    resolve_attention,
    to_local_name,
    to_te_name,
    transformer_engine_missing,
)


class _TEModule:
    """A stand-in for one TE module kind in the spec tree: the parameter names the real one registers."""

    @staticmethod
    def parameters(biased: bool) -> list[str]:
        raise NotImplementedError


class TELayerNormColumnParallelLinear(_TEModule):
    @staticmethod
    def parameters(biased):  # RMSNorm: no layer_norm_bias
        return ["layer_norm_weight", "weight"] + (["bias"] if biased else [])


class TEColumnParallelLinear(_TEModule):
    @staticmethod
    def parameters(biased):
        return ["weight"] + (["bias"] if biased else [])


class TERowParallelLinear(TEColumnParallelLinear):
    pass


class TELinear(TEColumnParallelLinear):
    pass


class TENorm(_TEModule):
    @staticmethod
    def parameters(biased):  # RMSNorm
        return ["weight"]


class TEDotProductAttention(_TEModule):
    @staticmethod
    def parameters(biased):
        return []


def _recording_provider():
    from megatron.core.models.backends import BackendSpecProvider

    class RecordingTESpecProvider(BackendSpecProvider):
        """What megatron's TESpecProvider returns, as markers (see its source in extensions/)."""

        def linear(self):
            return TELinear

        def column_parallel_linear(self):
            return TEColumnParallelLinear

        def row_parallel_linear(self):
            return TERowParallelLinear

        def fuse_layernorm_and_linear(self):
            return True

        def column_parallel_layer_norm_linear(self):
            return TELayerNormColumnParallelLinear

        def layer_norm(self, rms_norm=False, for_qk=False):
            return TENorm

        def core_attention(self):
            return TEDotProductAttention

        def grouped_mlp_modules(self, moe_use_grouped_gemm, moe_use_legacy_grouped_gemm):
            raise AssertionError("dense models only")

        def activation_func(self):
            return None

    return RecordingTESpecProvider


def te_decoder_parameter_names(monkeypatch, arch, num_layers: int) -> set[str]:
    """Parameter names of the decoder megatron's `get_gpt_decoder_block_spec(config, use_transformer_engine=True)`
    describes for `arch` (its layers and final norm), from the ModuleSpec tree. The linear_qkv has a bias when
    the architecture's q/k/v do: megatron passes `bias=add_bias_linear or add_qkv_bias` to it, and
    add_bias_linear=False (the bridge's) to every other linear."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_bridge.config_map import to_megatron

    monkeypatch.setattr(gpt_layer_specs, "TESpecProvider", _recording_provider(), raising=False)
    monkeypatch.setattr(gpt_layer_specs, "TENorm", TENorm, raising=False)
    hf = {"hidden_size": 64, "num_hidden_layers": num_layers, "num_attention_heads": 4, "num_key_value_heads": 2,
          "intermediate_size": 128, "vocab_size": 99}
    config, _ = to_megatron(hf, arch)
    block = gpt_layer_specs.get_gpt_decoder_block_spec(config, use_transformer_engine=True)

    def walk(submodules, prefix: str) -> list[str]:
        names = []
        for field in dataclasses.fields(submodules):
            value = getattr(submodules, field.name)
            if isinstance(value, ModuleSpec) and value.submodules is not None:
                names += walk(value.submodules, f"{prefix}{field.name}.")
            elif isinstance(value, ModuleSpec):
                value = value.module
            if isinstance(value, type) and issubclass(value, _TEModule):
                biased = arch.qkv_bias and field.name == "linear_qkv"
                names += [f"{prefix}{field.name}.{param}" for param in value.parameters(biased)]
        return names

    names = [name for i, layer in enumerate(block.layer_specs) for name in walk(layer.submodules,
                                                                                f"decoder.layers.{i}.")]
    assert block.layer_norm is TENorm
    names += [f"decoder.final_layernorm.{param}" for param in TENorm.parameters(False)]
    assert len(names) == len(set(names))
    return set(names)


@pytest.mark.parametrize("arch_name", ["Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM",
                                       "Qwen2_5_VLForConditionalGeneration"])
def test_translated_table_is_exactly_the_te_specs_parameters(megatron_single_rank, monkeypatch, arch_name):
    arch = ARCHITECTURES[arch_name]
    expected = te_decoder_parameter_names(monkeypatch, arch, num_layers=2)
    rows = arch.rows(num_layers=2, tied_embeddings=False)
    decoder = {to_te_name(mcore) for mcore, _, _ in rows if mcore.startswith("decoder.")}
    assert decoder == expected
    # the embedding and output layer are megatron's own modules in both specs: no names change outside the layers
    outside = [mcore for mcore, _, _ in rows if not mcore.startswith("decoder.layers.")]
    assert [to_te_name(name) for name in outside] == outside
    # and back: every TE name maps to exactly one table name
    assert {to_local_name(to_te_name(mcore)) for mcore, _, _ in rows} == {mcore for mcore, _, _ in rows}


def _holding_te_names(model):
    """`model` (torch spec) with each layer's norm weights moved where the TE spec keeps them: registered on
    linear_qkv / linear_fc1 as `layer_norm_weight`, the norms replaced by IdentityOp."""
    from megatron.core.transformer.identity_op import IdentityOp

    for layer in model.decoder.layers:
        layer.self_attention.linear_qkv.register_parameter("layer_norm_weight", layer.input_layernorm.weight)
        layer.mlp.linear_fc1.register_parameter("layer_norm_weight", layer.pre_mlp_layernorm.weight)
        layer.input_layernorm, layer.pre_mlp_layernorm = IdentityOp(), IdentityOp()
    return model


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_bridge_loads_and_exports_a_model_holding_the_te_names(megatron_single_rank, monkeypatch, tmp_path, arch):
    """The bridge's table check, loading and export on a model whose parameters carry the TE spec's names: the
    torch-spec model with each layer's norm weights moved where the TE spec keeps them (into linear_qkv and
    linear_fc1, the norms replaced by IdentityOp, as in the TE spec). Only names are tested here, not TE."""
    from safetensors.torch import load_file

    from megatron_bridge import Bridge
    from tests.helpers import make_tiny_model

    hf = make_tiny_model(str(tmp_path / "hf"), arch, tie_word_embeddings=False, num_layers=2)
    bridge = Bridge.from_hf_pretrained(hf)
    model = _holding_te_names(bridge.to_megatron_model(load_weights=False, attention="torch")[0])
    names = {name for name, _ in model.named_parameters()}
    assert names == te_decoder_parameter_names(monkeypatch, bridge.arch, 2) | {
        "embedding.word_embeddings.weight", "output_layer.weight"}
    bridge.load_hf_weights([model])
    exported = {name: t for bucket in bridge.export_hf_weights([model]) for name, t in bucket}
    original = load_file(f"{hf}/model.safetensors")
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    del model.decoder.layers[0].mlp.linear_fc1.layer_norm_weight  # a TE name the model lacks: named by the check
    with pytest.raises(KeyError, match=r"not in the model \['decoder.layers.0.pre_mlp_layernorm.weight'\]"):
        bridge.load_hf_weights([model])


def test_translation_is_the_pairs_megatrons_local_spec_declares():
    """Megatron's local spec maps its norm names to the TE spec's in sharded checkpoints: the same pairs."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    keys_map = get_gpt_layer_local_spec(normalization="RMSNorm").submodules.sharded_state_dict_keys_map
    assert {local + "weight": te + "weight" for local, te in keys_map.items()} == TE_NAMES


def test_only_decoder_layer_names_are_translated():
    assert to_te_name("decoder.layers.7.input_layernorm.weight") == \
        "decoder.layers.7.self_attention.linear_qkv.layer_norm_weight"
    assert to_te_name("decoder.layers.0.pre_mlp_layernorm.weight") == \
        "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"
    assert to_local_name("decoder.layers.3.mlp.linear_fc1.layer_norm_weight") == \
        "decoder.layers.3.pre_mlp_layernorm.weight"
    for unchanged in ("decoder.final_layernorm.weight", "decoder.layers.2.self_attention.q_layernorm.weight",
                      "decoder.layers.2.self_attention.linear_qkv.weight", "vision.blocks.0.norm1.weight"):
        assert to_te_name(unchanged) == unchanged == to_local_name(unchanged)


needs_no_te = pytest.mark.skipif(transformer_engine_missing() is None, reason="Transformer Engine can run here")


@needs_no_te
def test_auto_is_torch_without_transformer_engine():
    assert resolve_attention("auto") == "torch"
    for explicit in ("torch", "local"):
        assert resolve_attention(explicit) == explicit
    assert auto_reason() == f"torch: Transformer Engine cannot run here ({transformer_engine_missing()})"


def test_auto_never_picks_the_spec_no_gpu_run_has_checked(monkeypatch):
    """Where Transformer Engine can run, `auto` still picks torch until the device checks have passed on a GPU."""
    monkeypatch.setattr(layer_spec_module, "transformer_engine_missing", lambda: None)  # as on a TE image
    assert layer_spec_module.TE_SPEC_CHECKED_ON_GPU is False
    assert resolve_attention("auto") == "torch"
    assert "its spec has not yet passed the GPU device checks" in auto_reason()
    monkeypatch.setattr(layer_spec_module, "TE_SPEC_CHECKED_ON_GPU", True)
    assert resolve_attention("auto") == "te" and auto_reason() == "te: Transformer Engine runs here"


@needs_no_te
def test_te_without_transformer_engine_names_the_key_and_what_is_missing():
    with pytest.raises(RuntimeError, match=r"model\.attention=te needs Transformer Engine on a CUDA GPU: ") as error:
        resolve_attention("te")
    missing = transformer_engine_missing()
    assert missing in str(error.value)
    assert ("no CUDA device" in missing) if not torch.cuda.is_available() else ("transformer_engine" in missing)


def test_unknown_attention_names_the_choices():
    with pytest.raises(ValueError, match=r"model\.attention='flash': choose one of auto, te, torch, local"):
        resolve_attention("flash")


@needs_no_te
def test_bridge_refuses_te_without_transformer_engine(megatron_single_rank, tmp_path):
    from megatron_bridge import Bridge
    from tests.helpers import make_tiny_qwen2

    bridge = Bridge.from_hf_pretrained(make_tiny_qwen2(str(tmp_path / "hf"), tie_word_embeddings=True))
    with pytest.raises(RuntimeError, match=r"model\.attention=te needs Transformer Engine"):
        bridge.to_megatron_model(load_weights=False, attention="te")
    # auto builds our SDPA attention here
    from megatron_bridge.attention import TorchCoreAttention

    model = bridge.to_megatron_model(load_weights=False, attention="auto")[0]
    assert isinstance(model.decoder.layers[0].self_attention.core_attention, TorchCoreAttention)


def test_config_accepts_the_choices_and_refuses_local_with_packing(tmp_path):
    from rl360.config import ConfigError, load_config

    base = [f"model.path={tmp_path}", f"data.train_files=[{tmp_path}/x.parquet]"]
    assert load_config(None, base).model.attention == "auto"
    for value in ("te", "torch", "local", "auto"):
        assert load_config(None, [*base, f"model.attention={value}"]).model.attention == value
    with pytest.raises(ConfigError, match="model.attention"):
        load_config(None, [*base, "model.attention=flash"])
    with pytest.raises(ConfigError, match="actor.pack_sequences=true needs model.attention=auto, te or torch"):
        load_config(None, [*base, "model.attention=local", "actor.pack_sequences=true"])


# ---- checkpoints across layer specs ---------------------------------------------------------------------------

def test_checkpoint_loads_into_another_spec_leaving_te_extra_state_out(megatron_single_rank, tmp_path):
    """The specs save the same keys except TE's `_extra_state` entries (q/k and final norms): a checkpoint of the
    torch spec loads where those are asked for too; anything else it lacks is an error naming it."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from megatron_bridge import Bridge
    from megatron_bridge.checkpoint import load_checkpoint, load_sharded, save_checkpoint
    from tests.helpers import make_tiny_model

    bridge = Bridge.from_hf_pretrained(make_tiny_model(str(tmp_path / "hf"), "qwen3", tie_word_embeddings=False,
                                                       num_layers=2))
    saved = bridge.to_megatron_model(load_weights=True, attention="torch")
    save_checkpoint(bridge, saved, tmp_path / "ckpt")
    fresh = bridge.to_megatron_model(load_weights=False, attention="local")
    load_checkpoint(fresh, tmp_path / "ckpt")
    for (name, a), (_, b) in zip(saved[0].state_dict().items(), fresh[0].state_dict().items()):
        assert a is None and b is None or torch.equal(a, b), name

    def asking_also_for(key: str) -> dict:
        request = fresh[0].sharded_state_dict()
        request[key] = ShardedObject(key, None, (1,), (0,), replica_id=0)
        return request

    te_extra = "decoder.layers.self_attention.q_layernorm._extra_state"  # what TE's q norm adds (TENorm)
    assert te_extra not in load_sharded(asking_also_for(te_extra), tmp_path / "ckpt")
    with pytest.raises(KeyError, match=r"lacks \['decoder.layers.self_attention.linear_qkv.layer_norm_bias'\]"):
        load_sharded(asking_also_for("decoder.layers.self_attention.linear_qkv.layer_norm_bias"), tmp_path / "ckpt")


def test_checkpoint_of_the_torch_spec_loads_into_a_model_holding_the_te_names(megatron_single_rank, tmp_path):
    """Megatron's local spec saves its norms under the TE spec's keys: a model holding the TE names reads them."""
    from safetensors.torch import load_file

    from megatron_bridge import Bridge
    from megatron_bridge.checkpoint import load_checkpoint, save_checkpoint
    from tests.helpers import make_tiny_model

    hf = make_tiny_model(str(tmp_path / "hf"), "qwen3", tie_word_embeddings=True, num_layers=2)
    bridge = Bridge.from_hf_pretrained(hf)
    save_checkpoint(bridge, bridge.to_megatron_model(load_weights=True, attention="torch"), tmp_path / "ckpt")
    model = _holding_te_names(bridge.to_megatron_model(load_weights=False, attention="torch")[0])
    load_checkpoint([model], tmp_path / "ckpt")
    exported = {name: t for bucket in bridge.export_hf_weights([model]) for name, t in bucket}
    for name, tensor in load_file(f"{hf}/model.safetensors").items():
        assert torch.equal(exported[name], tensor), name


def test_model_state_loads_without_extra_state_but_not_without_a_weight():
    from megatron_bridge.checkpoint import load_model_state

    class WithExtraState(torch.nn.Linear):  # as a Transformer Engine module keeps its fp8 metadata
        def get_extra_state(self):
            return torch.zeros(0)

        def set_extra_state(self, state):
            pass

    model = torch.nn.Sequential(WithExtraState(2, 2), torch.nn.Linear(2, 2))
    state = {key: value for key, value in model.state_dict().items() if not key.endswith("_extra_state")}
    assert "0._extra_state" in model.state_dict() and "0._extra_state" not in state
    load_model_state(model, state)
    del state["1.weight"]
    with pytest.raises(KeyError, match=r"missing \['1.weight'\]"):
        load_model_state(model, state)


# ---- on a GPU with Transformer Engine (skipped elsewhere) -----------------------------------------------------

needs_te = pytest.mark.skipif(transformer_engine_missing() is not None,
                              reason=f"needs Transformer Engine on CUDA: {transformer_engine_missing()}")


def _te_model(tmp_path, arch: str, tied: bool, dtype: torch.dtype, save_dtype: torch.dtype | None = None):
    from transformers import AutoModelForCausalLM

    from megatron_bridge import Bridge
    from tests.helpers import make_tiny_model

    hf = make_tiny_model(str(tmp_path / "hf"), arch, tie_word_embeddings=tied, num_layers=2)
    if save_dtype is not None:
        AutoModelForCausalLM.from_pretrained(hf).to(save_dtype).save_pretrained(hf)
    bridge = Bridge.from_hf_pretrained(hf)
    return hf, bridge, bridge.to_megatron_model(load_weights=True, params_dtype=dtype, attention="te")


@pytest.mark.gpu
@needs_te
@pytest.mark.parametrize("arch, tied", [("qwen2", True), ("qwen3", False), ("llama", False)])
def test_te_spec_hf_round_trip_is_bitwise(megatron_single_rank, tmp_path, arch, tied):
    from safetensors.torch import load_file

    hf, bridge, models = _te_model(tmp_path, arch, tied, torch.bfloat16, save_dtype=torch.bfloat16)
    layer = models[0].decoder.layers[0]
    assert type(layer.self_attention.core_attention).__name__ == "TEDotProductAttention"
    names = {name for name, _ in models[0].named_parameters()}
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in names
    assert not any("input_layernorm" in name or "pre_mlp_layernorm" in name for name in names)
    original = load_file(f"{hf}/model.safetensors")
    exported = {name: t for bucket in bridge.export_hf_weights(models) for name, t in bucket}
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == torch.bfloat16 and torch.equal(exported[name], tensor), name


def _logits(model, ids, positions=None, packed=None):
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids) if positions is None else positions
    with torch.no_grad():
        return model.eval()(ids, positions, None, packed_seq_params=packed).float()


@pytest.mark.gpu
@needs_te
@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_te_spec_logits_match_transformers_in_bf16(megatron_single_rank, tmp_path, arch):
    """bf16 through TE is no further from transformers' fp32 logits than transformers' own bf16 logits are
    (twice their distance, plus 0.01); packed THD rows give each sequence's logits as it alone does."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from transformers import AutoModelForCausalLM

    hf, _, models = _te_model(tmp_path, arch, tied=False, dtype=torch.bfloat16)
    model = models[0]
    ids = torch.randint(1, 99, (2, 48), generator=torch.Generator().manual_seed(0)).cuda()
    ours = _logits(model, ids)[..., :99]
    reference = AutoModelForCausalLM.from_pretrained(hf, attn_implementation="sdpa").cuda().eval()
    with torch.no_grad():
        full = reference(ids).logits.float()
        half = reference.to(torch.bfloat16)(ids).logits.float()
    bf16_error = (half - full).abs().max().item()
    assert (ours - full).abs().max().item() <= 2 * bf16_error + 1e-2
    starts = torch.tensor([0, 48, 96], dtype=torch.int32, device="cuda")
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=starts, cu_seqlens_kv=starts, max_seqlen_q=48,
                             max_seqlen_kv=48)
    positions = torch.arange(48, device="cuda").repeat(2)[None]
    together = _logits(model, ids.reshape(1, -1), positions, packed)[..., :99].reshape(2, 48, -1)
    assert (together - ours).abs().max().item() <= 2 * bf16_error + 1e-2
