"""Data of tool-using agents (DeepEyes, PyVision): rows with each record's own data_source and a system prompt
that describes rl360's tools."""
