"""Migration 9: checkpoints: the converter that made an export (llama.cpp's convert_hf_to_gguf.py for gguf)."""

VERSION = 9
DESCRIPTION = "checkpoints: the converter that made an export (llama.cpp's convert_hf_to_gguf.py for gguf)"
SQL = """
        ALTER TABLE checkpoints ADD COLUMN converter VARCHAR;
        """
