"""Math datasets: the answer is a LaTeX/plain string, compared with the last \\boxed{} of the response."""
