"""`bench lm`: the sync strategies on a byte-level GPT across emulated WAN regions (run, workload, rounds)."""
