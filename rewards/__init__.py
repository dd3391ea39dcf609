"""Your reward functions, for the ppo stage's `scorer.source: callable` (`scorer.name: rewards.<module>:<function>`).

This package is a dependency of the ppo stage in dvc.yaml: editing any file here makes `dvc status` report ppo as
changed, and the next `dvc repro` reruns ppo and evaluate. A reward function takes the list of texts (each query
followed by the policy's response, as decoded) and returns one finite number per text, in order. See example.py.
"""
