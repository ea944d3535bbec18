"""The fork's experiments (``--module NAME`` finds them after ``torchtitan.models``)."""
