"""Export: a trained draft written in the formats servers load, and read back."""
