"""Weights from the trainer into rollout engines, on SGLang's protocol: one module per strategy, the sender that
runs one, and the formats both sides share (the actor sends through `sender`; the engine server reads `formats`,
`cuda_ipc` and `group`).

- `registry`: each strategy module registers its strategy there, with the engines it reaches and whether it
  shares a GPU or needs the sender's host; the config, the placement and the sender read it.
- `sender`: `WeightSender`, a full update (every bucket into every engine, the last marks it complete).
- `distributed`: a torch.distributed group with the engines, one broadcast per tensor (real SGLang engines too).
- `tensor`: engines on this host: CUDA IPC for CUDA buckets (`cuda_ipc`), shared-memory files for the others.
- `disk`: safetensors shards in a directory every engine loads.
- a new strategy: a module of this package registering its class (`registry.register_strategy`).
- `formats`, `flat_bucket`, `cuda_ipc`: the wire formats; `group`: the process group as both sides make it;
  `calls`: the sender's requests to its engines.
"""
