"""The policy's resumable checkpoints (megatron-core distributed checkpoints of weights and optimizer state,
loadable at any TP x PP x DP layout) and, for a LoRA policy, its adapters (in the checkpoint and as a PEFT
directory).

`PolicyCheckpoints` is a part of `rl360.actor.policy.PolicyWorker`; it reads the worker's `settings`, `models`,
`optimizer`, `lora`, `bridge` and `_resident` (the offload context).
"""

from __future__ import annotations

import json
import os

import torch

from megatron_bridge.lora import is_adapter_name, peft_tensors, write_peft_dir
from rl360.actor.parallel import unwrap

OPTIMIZER_KIND_FILE = "rl360_optimizer.json"
LORA_FILE = "lora.json"  # a LoRA policy's checkpoint: the adapters' settings and the base model they sit on


class PolicyCheckpoints:
    def save_checkpoint(self, ckpt_dir: str) -> None:
        """Weights and optimizer state as a megatron-core distributed checkpoint (every rank takes part)."""
        from megatron.core import dist_checkpointing

        if torch.distributed.get_rank() == 0:
            os.makedirs(ckpt_dir, exist_ok=True)
        torch.distributed.barrier()
        with self._resident("weights", "optimizer"):
            dist_checkpointing.save(self._checkpoint_state(), ckpt_dir)
        if torch.distributed.get_rank() == 0:  # the optimizer's kind: the two keep their state in different forms
            with open(os.path.join(ckpt_dir, OPTIMIZER_KIND_FILE), "w") as f:
                json.dump({"distributed_optimizer": self.settings.actor.distributed_optimizer}, f)
            if self.lora is not None:
                with open(os.path.join(ckpt_dir, LORA_FILE), "w") as f:
                    json.dump(self._lora_record(), f, indent=2)
        torch.distributed.barrier()  # complete on every rank's return (a load right after reads the kind)

    def load_checkpoint(self, ckpt_dir: str) -> None:
        """Restore what `save_checkpoint` wrote (the same TP x PP layout or another, either layer spec)."""
        from megatron_bridge.checkpoint import load_model_state, load_sharded

        kind_file = os.path.join(ckpt_dir, OPTIMIZER_KIND_FILE)
        saved = json.load(open(kind_file))["distributed_optimizer"] if os.path.exists(kind_file) else False
        wanted = self.settings.actor.distributed_optimizer
        if saved != wanted:
            raise ValueError(f"{ckpt_dir} holds the state of a {'distributed' if saved else 'non-distributed'} "
                             f"optimizer; this run has actor.distributed_optimizer={str(wanted).lower()} (resume with "
                             f"actor.distributed_optimizer={str(saved).lower()})")
        self._check_lora_checkpoint(ckpt_dir)
        with self._resident("weights", "optimizer"):
            state = load_sharded(self._checkpoint_state(loading=True), ckpt_dir)  # (either layer spec's)
            for key, chunk in zip(self._model_keys(), self.models):
                if self.lora is not None:
                    load_adapter_state(unwrap(chunk), state[key])
                else:
                    load_model_state(unwrap(chunk), state[key])
            self.optimizer.load_state_dict(state["optimizer"])

    def _checkpoint_state(self, loading: bool = False) -> dict:
        """Sharded weights and optimizer state; when loading, the optimizer first creates its (lazily made)
        Adam moments so the checkpoint has somewhere to go."""
        model_state = {key: unwrap(chunk).sharded_state_dict() for key, chunk in zip(self._model_keys(), self.models)}
        if self.lora is not None:  # the adapters alone: the base is model.path's
            model_state = {key: {name: value for name, value in state.items() if is_adapter_name(name)}
                           for key, state in model_state.items()}
        # the distributed optimizer's state dict needs Adam's step: one zero step makes it (overwritten by the load)
        if loading and self.settings.actor.distributed_optimizer:
            for part in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                if not part.optimizer.state:
                    part._init_optimizer_states_with_dummy_values()
        # the distributed optimizer's state in the canonical per-parameter layout, loadable at any TP x PP x DP
        metadata = {"distrib_optim_sharding_type": "fully_reshardable"}
        return {**model_state,
                "optimizer": self.optimizer.sharded_state_dict(model_state, is_loading=loading, metadata=metadata)}

    def _lora_record(self) -> dict:
        spec = self.lora
        return {"rank": spec.rank, "alpha": spec.alpha, "dropout": spec.dropout, "targets": list(spec.targets),
                "base_model": os.path.abspath(self.settings.model.path), "dtype": self.settings.model.dtype,
                "model_keys": self._model_keys()}

    def _check_lora_checkpoint(self, ckpt_dir: str) -> None:
        """A checkpoint of adapters resumes only a LoRA policy with the same adapters (and a full one only a full
        policy)."""
        path = os.path.join(ckpt_dir, LORA_FILE)
        saved = json.load(open(path)) if os.path.exists(path) else None
        if saved is None and self.lora is None:
            return
        if saved is None or self.lora is None:
            raise ValueError(f"{ckpt_dir} holds {'LoRA adapters' if saved else 'a whole model'}; this run has "
                             f"actor.lora.rank={self.lora.rank if self.lora else 0} (resume with actor.lora."
                             f"rank={saved['rank'] if saved else 0})")
        mine = self._lora_record()
        for key in ("rank", "alpha", "targets"):
            if saved[key] != mine[key]:
                raise ValueError(f"{ckpt_dir} holds LoRA adapters with {key}={saved[key]}; this run has "
                                 f"actor.lora.{key}={mine[key]} (resume with the checkpoint's)")

    def lora_state(self, gradients: bool = False) -> dict[str, torch.Tensor]:
        """The adapters whole, in PEFT's names (or, with `gradients`, their accumulated gradients); a collective of
        every rank."""
        if self.lora is None:
            raise RuntimeError("actor.lora.rank is 0: this policy has no adapters")
        value = (lambda param: param.main_grad) if gradients else None
        with self._resident("weights", "grads") if gradients else self._resident("weights"):
            return peft_tensors(self.models, self.bridge.weight_hf_names(), value)

    def save_peft(self, out_dir: str) -> str:
        """Write a PEFT adapter directory (adapter_config.json, adapter_model.safetensors); global rank 0 writes."""
        tensors = self.lora_state()
        if torch.distributed.get_rank() == 0:
            write_peft_dir(out_dir, tensors, self.lora, os.path.abspath(self.settings.model.path))
        return out_dir

    def _model_keys(self) -> list[str]:
        """State-dict key of each model chunk: "model", or "model0", "model1", ... with virtual pipeline stages
        (megatron's names; the tensors inside are keyed by global layer, so any layout loads them)."""
        return ["model"] if len(self.models) == 1 else [f"model{i}" for i in range(len(self.models))]


def load_adapter_state(model: torch.nn.Module, state: dict) -> None:
    """Load a checkpoint's adapters into `model`: every adapter of the model, nothing else."""
    result = model.load_state_dict(state, strict=False)
    missing = sorted(key for key in result.missing_keys if is_adapter_name(key))
    if missing or result.unexpected_keys:
        raise KeyError(f"the checkpoint's adapters and the model's disagree: missing {missing[:8]}, unexpected "
                       f"{sorted(result.unexpected_keys)[:8]}")
