"""The models: the target (SmolLM2 of the embedded default, or a local folder) and the EAGLE-3 draft."""
