"""Regenerate: the target's own answers to kept prompts, and which pending prompts to send next."""
