"""The named choices of the math, in one leaf module (no torch, no other module of the package): the config, the
registry and the math read them from here, so that a stage can check a params file without loading the math.
"""

from __future__ import annotations

# The one KL vocabulary of the reward side (PPOConfig.kl_penalty) and the loss side (PPOConfig.kl_estimator): legacy
# TRL's names and Schulman's (2020, "Approximating KL divergence"); "kl" is k1, "mse" is k2. "full" needs the whole
# distributions (reward side only: see ppo_core.models.logprobs.full_kl).
KL_PENALTIES = ("kl", "k1", "abs", "mse", "k2", "k3", "full")
LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")  # PPOConfig.loss_aggregation's
POLICY_LOSSES = ("clip", "gspo", "cispo")  # the built-in policy losses (registry.POLICY_LOSS_REGISTRY holds users' too)
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")  # PPO's ratio per token, GSPO's per sequence
# How the step corrects for sampling from a rollout copy (PPOConfig.rollout_correction), TRL's vLLM modes: the weight
# per token or per sequence, above the cap truncated to it (TIS) or zeroed (masked importance sampling)
ROLLOUT_CORRECTIONS = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")

# TRL GRPOConfig's loss_type: the loss aggregation and the policy loss it stands for (TRL's "bnpo" takes the token
# mean of each process's batch; ppo_core's token mean is always the global batch's, DAPO's).
LOSS_TYPES = {"grpo": ("seq-mean-token-mean", "clip"), "bnpo": ("token-mean", "clip"),
              "dr_grpo": ("seq-mean-token-sum-norm", "clip"), "dapo": ("token-mean", "clip"),
              "cispo": ("token-mean", "cispo")}
