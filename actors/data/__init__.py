"""Prompt sources: built-in tasks, dataset files, weighted mixtures, and the one chat-template
helper (prompts are templated and tokenized once, here, never inside an engine)."""
