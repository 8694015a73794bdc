"""`rl360 serve ...`: HTTP services of our own (a SandboxFusion-compatible code sandbox)."""
