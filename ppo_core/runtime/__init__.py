"""Where the math runs: processes and their collectives, DeepSpeed ZeRO, mixed precision, checkpoints, and small
process-wide helpers (seeding, timing, the allocator). Imports nothing else of ppo_core."""
