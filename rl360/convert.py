"""`rl360 convert`: Hugging Face checkpoints <-> megatron-core distributed checkpoints at any TP x PP.

    rl360 convert hf-to-megatron --hf DIR --out DIR --tp N --pp M [--dtype auto|bfloat16|float32|float16]
    rl360 convert megatron-to-hf --ckpt DIR --out DIR [--tp N --pp M]
    rl360 convert lora-to-peft --ckpt DIR --out DIR [--tp N --pp M]

Each command starts its own TP x PP ranks as processes on this host (gloo on CPU, NCCL on GPUs).
Every rank reads only its slices of the HF files; the megatron checkpoint loads at any layout, so
`megatron-to-hf` may use fewer ranks than the checkpoint was saved with (memory allowing).

`--ckpt` takes a checkpoint written by `hf-to-megatron` (the weights alone), or one the trainer wrote: its
policy directory (`checkpoints/step_000020/policy`, weights beside the optimizer state), the step directory
(`checkpoints/step_000020`), or the checkpoints directory itself (its `latest`).

`lora-to-peft` takes the checkpoint of a LoRA policy (`actor.lora.rank` > 0, its adapters beside the optimizer
state) and writes a PEFT adapter directory (adapter_config.json, adapter_model.safetensors in PEFT's names) that
`peft.PeftModel.from_pretrained(base, DIR)` loads over the base model the run trained on.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from rl360.checkpointing import LATEST
from rl360.errors import UserError
from rl360.model_dir import check_model_dir

DTYPE_NAMES = ("auto", "bfloat16", "float32", "float16")


def hf_to_megatron_rank(hf_dir: str, out_dir: str, tp: str, pp: str, dtype: str) -> None:
    from megatron_bridge import Bridge
    from megatron_bridge.checkpoint import save_checkpoint
    from rl360.actor.parallel import destroy_parallel, init_parallel

    init_parallel(int(tp), int(pp))
    bridge = Bridge.from_hf_pretrained(hf_dir)
    models = bridge.to_megatron_model(load_weights=True, params_dtype=getattr(torch, dtype))
    save_checkpoint(bridge, models, out_dir)
    destroy_parallel()


def megatron_to_hf_rank(ckpt_dir: str, out_dir: str, tp: str, pp: str) -> None:
    from megatron_bridge.checkpoint import META_FILE, checkpoint_bridge, checkpoint_dtype, load_checkpoint
    from rl360.actor.parallel import destroy_parallel, init_parallel

    init_parallel(int(tp), int(pp))
    bridge = checkpoint_bridge(ckpt_dir)
    models = bridge.to_megatron_model(load_weights=False, params_dtype=checkpoint_dtype(ckpt_dir))
    model_key = json.loads((Path(ckpt_dir) / META_FILE).read_text()).get("model_state_key")
    if model_key is None:  # the weights alone, as hf-to-megatron saves them
        load_checkpoint(models, ckpt_dir)
    else:  # the trainer's {"model": weights, "optimizer": ...}: only the weights are read
        _load_nested_weights(models, ckpt_dir, model_key)
    bridge.save_hf_pretrained(models, out_dir)
    destroy_parallel()


def lora_to_peft_rank(ckpt_dir: str, out_dir: str, tp: str, pp: str) -> None:
    from megatron_bridge import Bridge
    from megatron_bridge.bridge import _unwrap
    from megatron_bridge.checkpoint import load_sharded
    from megatron_bridge.lora import LoraSpec, attach_adapters, is_adapter_name, peft_tensors, write_peft_dir
    from rl360.actor.parallel import destroy_parallel, init_parallel
    from rl360.actor.policy_checkpoints import LORA_FILE, load_adapter_state

    record = json.loads((Path(ckpt_dir) / LORA_FILE).read_text())
    spec = LoraSpec(record["rank"], record["alpha"], record["dropout"], tuple(record["targets"]))
    init_parallel(int(tp), int(pp))
    bridge = Bridge.from_hf_pretrained(record["base_model"])
    models = bridge.to_megatron_model(load_weights=False, params_dtype=getattr(torch, record["dtype"]),
                                      attention="torch")
    for model in models:
        attach_adapters(model, spec, seed=0)  # (the checkpoint's adapters replace the initial ones)
    states = {key: {name: value for name, value in _unwrap(model).sharded_state_dict().items()
                    if is_adapter_name(name)} for key, model in zip(record["model_keys"], models)}
    loaded = load_sharded(states, ckpt_dir)
    for key, model in zip(record["model_keys"], models):
        load_adapter_state(_unwrap(model), loaded[key])
    tensors = peft_tensors(models, bridge.weight_hf_names())
    if torch.distributed.get_rank() == 0:
        write_peft_dir(out_dir, tensors, spec, record["base_model"])
    destroy_parallel()


def _load_nested_weights(models: list, ckpt_dir: str, key: str) -> None:
    from megatron_bridge.bridge import _unwrap
    from megatron_bridge.checkpoint import load_model_state, load_sharded

    if len(models) != 1:
        raise ValueError(f"expected one model chunk per rank (no virtual pipeline stages), got {len(models)}")
    model = _unwrap(models[0])
    load_model_state(model, load_sharded({key: model.sharded_state_dict()}, ckpt_dir)[key])


def resolve_checkpoint(path: str | Path, marker: str | None = None) -> Path:
    """The policy checkpoint directory that `--ckpt` names (see the module docstring), holding `marker` (default
    the checkpoint info `rl360.json`), or `UserError`."""
    from megatron_bridge.checkpoint import META_FILE

    path = Path(path)
    if (path / LATEST).is_file():  # the trainer's checkpoints directory
        path = path / (path / LATEST).read_text().strip()
    if (path / "trainer.json").is_file():  # one of the trainer's checkpoints
        path = path / "policy"
    if marker is not None and not (path / marker).is_file():
        raise UserError(f"{path}/{marker} not found (--ckpt must be the checkpoint of a LoRA policy, "
                        "actor.lora.rank > 0: its step directory, its policy/ directory or the checkpoints directory)")
    if marker is None and not (path / META_FILE).is_file():
        raise UserError(f"{path}/{META_FILE} not found (--ckpt must be a checkpoint written by "
                        "`rl360 convert hf-to-megatron`, or one the trainer wrote: its step directory, its "
                        "policy/ directory or the checkpoints directory)")
    return path


def hf_dtype(hf_dir: str | Path) -> str:
    """The dtype a HF checkpoint declares (`dtype`, or `torch_dtype` in transformers 4), float32 if none."""
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    if name not in DTYPE_NAMES:
        raise ValueError(f"{hf_dir}/config.json: dtype {name!r} is not one of {DTYPE_NAMES[1:]}")
    return name


def check_layout(config_file: str | Path, tp: int, pp: int) -> None:
    """Refuse (`UserError`, before any rank starts) a TP x PP layout the model in `config_file` (a HF config.json)
    cannot be split into: each size >= 1, TP dividing the attention heads, the key/value heads and the MLP's
    intermediate size, PP dividing the layers."""
    for flag, size in (("--tp", tp), ("--pp", pp)):
        if size < 1:
            raise UserError(f"{flag} {size}: must be >= 1")
    if not Path(config_file).is_file():  # an older checkpoint without the model's config: sizes unchecked
        return
    config = json.loads(Path(config_file).read_text())
    text = config.get("text_config") or {}  # vision-language configs nest the language model's sizes

    def size_of(name: str) -> int | None:
        value = config.get(name, text.get(name))
        return value if isinstance(value, int) and value > 0 else None

    splits = {"--tp": (tp, {"num_attention_heads": "attention heads", "num_key_value_heads": "key/value heads",
                            "intermediate_size": "MLP intermediate size"}),
              "--pp": (pp, {"num_hidden_layers": "layers"})}
    for flag, (size, names) in splits.items():
        totals = {name: size_of(name) for name in names if size_of(name) is not None}
        for name, total in totals.items():
            if total % size:
                fits = [str(n) for n in range(1, 65) if all(value % n == 0 for value in totals.values())]
                raise UserError(f"{flag} {size} does not divide the model's {total} {names[name]} "
                                f"({name} in {config_file}); {flag} can be {', '.join(fits)}")


def check_new_output(out: str | Path) -> None:
    """`UserError` when `--out` is a file or a directory with something in it (a conversion writes a new one)."""
    out = Path(out)
    if out.is_file():
        raise UserError(f"--out {out} is a file; give a directory to create")
    if out.is_dir() and any(out.iterdir()):
        raise UserError(f"--out {out} already exists and is not empty; give a new directory (or remove that one)")


def _hf_to_megatron(args: argparse.Namespace) -> int:
    from rl360.cluster.launch import run_ranks

    check_model_dir(args.hf, "--hf", tokenizer=False)
    check_layout(Path(args.hf) / "config.json", args.tp, args.pp)
    check_new_output(args.out)
    dtype = hf_dtype(args.hf) if args.dtype == "auto" else args.dtype
    run_ranks("rl360.convert:hf_to_megatron_rank", args.tp * args.pp,
              [args.hf, args.out, str(args.tp), str(args.pp), dtype])
    print(f"wrote megatron checkpoint (TP={args.tp}, PP={args.pp}, {dtype}) to {args.out}")
    return 0


def _megatron_to_hf(args: argparse.Namespace) -> int:
    from rl360.cluster.launch import run_ranks

    ckpt = resolve_checkpoint(args.ckpt)
    from megatron_bridge.checkpoint import HF_SUBDIR
    from rl360.actor.policy_checkpoints import LORA_FILE

    if (ckpt / LORA_FILE).is_file():
        raise UserError(f"{ckpt} holds LoRA adapters, not a whole model: write them as a PEFT adapter with "
                        f"`rl360 convert lora-to-peft --ckpt {args.ckpt} --out DIR` (the run's merged model is "
                        "its hf/ export)")

    check_layout(ckpt / HF_SUBDIR / "config.json", args.tp, args.pp)
    check_new_output(args.out)
    run_ranks("rl360.convert:megatron_to_hf_rank", args.tp * args.pp, [str(ckpt), args.out, str(args.tp),
                                                                        str(args.pp)])
    print(f"wrote Hugging Face checkpoint of {ckpt} to {args.out}")
    return 0


def _lora_to_peft(args: argparse.Namespace) -> int:
    from rl360.actor.policy_checkpoints import LORA_FILE
    from rl360.cluster.launch import run_ranks

    ckpt = resolve_checkpoint(args.ckpt, LORA_FILE)
    record = json.loads((ckpt / LORA_FILE).read_text())
    check_layout(Path(record["base_model"]) / "config.json", args.tp, args.pp)
    check_new_output(args.out)
    run_ranks("rl360.convert:lora_to_peft_rank", args.tp * args.pp, [str(ckpt), args.out, str(args.tp),
                                                                      str(args.pp)])
    print(f"wrote PEFT adapter (rank {record['rank']}, alpha {record['alpha']:g}) of {ckpt} to {args.out}; base "
          f"model {record['base_model']}")
    return 0


def add_convert_parser(commands) -> None:
    convert = commands.add_parser("convert", help="convert checkpoints between Hugging Face and megatron-core")
    kinds = convert.add_subparsers(dest="convert_command", required=True)
    to_mcore = kinds.add_parser("hf-to-megatron", help="HF model dir -> megatron distributed checkpoint")
    to_mcore.add_argument("--hf", required=True, help="Hugging Face model directory")
    to_mcore.add_argument("--out", required=True, help="checkpoint directory to create")
    to_mcore.add_argument("--tp", type=int, default=1, help="tensor-parallel size (processes = tp * pp)")
    to_mcore.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    to_mcore.add_argument("--dtype", choices=DTYPE_NAMES, default="auto", help="parameter dtype (auto: the HF one)")
    to_mcore.set_defaults(run=_hf_to_megatron)
    to_hf = kinds.add_parser("megatron-to-hf", help="megatron distributed checkpoint -> HF model dir")
    to_hf.add_argument("--ckpt", required=True, help="checkpoint directory (or the trainer's step or checkpoints "
                       "directory)")
    to_hf.add_argument("--out", required=True, help="Hugging Face model directory to write")
    to_hf.add_argument("--tp", type=int, default=1, help="tensor-parallel size to load it at")
    to_hf.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to load it at")
    to_hf.set_defaults(run=_megatron_to_hf)
    to_peft = kinds.add_parser("lora-to-peft", help="a LoRA policy's checkpoint -> PEFT adapter dir")
    to_peft.add_argument("--ckpt", required=True, help="the policy's checkpoint directory (or the trainer's step or "
                         "checkpoints directory)")
    to_peft.add_argument("--out", required=True, help="PEFT adapter directory to write")
    to_peft.add_argument("--tp", type=int, default=1, help="tensor-parallel size to load it at")
    to_peft.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to load it at")
    to_peft.set_defaults(run=_lora_to_peft)
