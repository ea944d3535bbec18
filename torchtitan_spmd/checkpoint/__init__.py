"""Checkpointing: the DCP manager, its integrity checks and Hugging Face weights."""
