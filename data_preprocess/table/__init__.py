"""Table reasoning: tables rendered as markdown; the answer is compared with the last \\boxed{}."""
