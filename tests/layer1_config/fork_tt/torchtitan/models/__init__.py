"""The fork's model families (``--module NAME`` finds ``torchtitan.models.NAME`` first)."""
