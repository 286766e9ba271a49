"""llama.cpp: the portable build, `llama-server` started here, the draft's GGUF export and llama.cpp's side of the serving contract."""
