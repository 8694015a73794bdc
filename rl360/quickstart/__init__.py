"""Everything the CPU quickstart needs, made locally: a tiny tokenizer, a tiny random model, the task."""
