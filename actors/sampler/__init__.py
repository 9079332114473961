"""Sampler actor: prompts in, scored groups out, new weights picked up between batches."""
