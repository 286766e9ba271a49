"""Extract: conversations tokenised with the serving template, the draft vocabulary, target hidden states packed into shards."""
