"""Evaluate: offline acceptance length of a draft against the target, the held-out chat set, per-cluster probes and plots."""
