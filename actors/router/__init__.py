"""The router: forwards envelopes to pools of workers (``state`` decides, ``actor`` serves)."""
