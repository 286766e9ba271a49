"""Train: the EAGLE-3 draft trained with training-time test on extracted shards, resumable from checkpoints."""
