"""Weights transports: one seam (``base.py``), one file per transport, one table.

Torch-free at import: the config checks read ``base.TRANSPORTS`` and ``resolve_transport``.
"""
