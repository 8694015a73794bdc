"""The engines themselves: what samples tokens from a model.

- `hf_engine`: `HFEngine`, the Hugging Face transformers engine (the embedded default, CPU or GPU), used in a Ray
  actor by the fleet (`rollout.engine=hf`), behind `rl360 serve rollout` and behind `rl360 serve model`.
- `server`: `rl360 serve rollout`, the HF engine behind SGLang's native HTTP API (generation, weight updates in
  every `rl360.weight_sync` format, pause/continue, memory release); `batching` (continuous batching) and
  `generate_request` (parsing `/generate`) are its parts.
- `stop_strings`: stop strings found in incrementally decoded tokens (SGLang's `stop`, OpenAI's `stop`), for the
  HF engine, the batching engine, `rl360 serve model`'s choices and the fleet's continued samples.
"""
