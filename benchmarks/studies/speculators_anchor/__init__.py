"""The anchor of the recipe study (issue 42): vLLM's own trainer, `speculators` (PyPI 0.9.0), on our data.

Three parts, split by the environment they run in:
- `convert.py` (the project venv): our extraction's shards and draft vocab to
  speculators' offline data folder, every sample, nothing changed but the layout;
- `train_cpu.py` (`.venv-speculators` only, `make speculators`): speculators' own training entry point with the
  few runtime patches a CPU-only machine needs (no file of the package is edited);
- `run.py` (the project venv): converts once, trains (resumable), and imports the checkpoint in the speculators
  format our loader and vLLM read, so the recipe study measures it as one more arm (`speculators-*`).
docs/results/2026-12-06-recipe-anchor.md says what differs from its defaults, and why.
"""
