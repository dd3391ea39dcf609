"""What one ``PPOTrainer.step()`` runs on the models: the rollout passes and their ``Rollout``, a mini-batch's update,
the statistics, and the data the loop feeds it. Imports ``algo``, ``runtime``, ``models`` and ``config``."""
