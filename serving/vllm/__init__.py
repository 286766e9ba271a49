"""vLLM: servers for extraction (hidden states) and for serving the draft or its n-gram method, and vLLM's side of the serving contract."""
