"""Generation engines behind one protocol (``base.Engine``): token ids in, token ids and
per-token behaviour log-probs, policy versions and loss mask out."""
