"""The math: pure tensor functions (losses, KL, advantages, masked statistics) and the estimators' registry.

Imports nothing else of ppo_core: no model, no process group, no config (a function that sums over processes takes
that sum as an argument)."""
