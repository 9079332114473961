"""Learner actor: batches in, optimizer steps, versioned weights and checkpoints out."""
