"""Weights from the trainer into rollout engines, on SGLang's protocol: one module per strategy, the sender that
runs one, and the formats both sides share (the actor sends through `sender`; the engine server reads `formats`,
`cuda_ipc` and `group`).

- `sender`: `WeightSender`, a full update (every bucket into every engine, the last marks it complete).
- `distributed`: a torch.distributed group with the engines, one broadcast per tensor (real SGLang engines too).
- `tensor`: engines on this host: CUDA IPC for CUDA buckets (`cuda_ipc`), shared-memory files for the others.
- `disk`: safetensors shards in a directory every engine loads.
- `formats`, `flat_bucket`, `cuda_ipc`: the wire formats; `group`: the process group as both sides make it;
  `calls`: the sender's requests to its engines.
"""
