"""Chat transports. ``openai-compat`` (``transports.openai_compat``) is the builtin one.

Submodules are imported on use: ``sse`` and ``errors`` are pure (no I/O), ``engines`` holds the
HTTP clients, ``openai_compat`` puts them together.
"""
