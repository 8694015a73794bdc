"""Code simulation: predict what a program does (its output, or an input that gives an output)."""
