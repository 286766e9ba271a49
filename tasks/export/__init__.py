"""Export: the engine-neutral part of a trained draft written for servers and read back (checkpoint.py); each engine's writer is its serving/ package's export.py."""
