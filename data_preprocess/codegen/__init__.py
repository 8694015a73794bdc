"""Code-generation datasets: the ground truth is stdin/stdout tests or test code run after the solution."""
