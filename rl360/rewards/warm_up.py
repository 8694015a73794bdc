"""Imported once by the reward pool's forkserver (`rl360.rewards.pool`), before it forks any worker.

Importing the rewards leaves work for their first call: math-verify's LaTeX parser builds its ANTLR tables
on first use (about 0.1 s, several times that on a loaded node). Done here, in the forkserver, every worker
forked from it starts with the tables built, so no reward call pays for them inside its timeout.
"""

from rl360.rewards.math import is_equiv

is_equiv("\\frac{1}{2}", "0.5")
