"""STEM questions: the answer (a value, or a choice letter) is compared with the last \\boxed{}."""
