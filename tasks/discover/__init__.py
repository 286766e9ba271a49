"""Discover: raw records from sources, normalised into prompts, deduplicated (exact and near), decontaminated and given an outcome each."""
