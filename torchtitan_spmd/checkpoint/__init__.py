"""Checkpointing, above the models: :mod:`.manager` (DCP save, load and purge),
:mod:`.integrity` (per-file checksums and the completion marker) and :mod:`.hf`
(Hugging Face safetensors load and export). Importing the package imports none of them.
"""
