"""The models: value-head wrappers over transformers models, log-probabilities without full-vocabulary logits,
sampling, the reference policy, weights on disk and PEFT adapters. Imports ``algo`` and ``runtime`` only."""
