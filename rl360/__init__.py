"""rl360: reinforcement-learning post-training with Megatron-core, SGLang and Ray."""

__version__ = "0.1.0"
