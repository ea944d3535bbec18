"""Run-time helpers that are not distributed techniques (upstream's ``torchtitan.tools``)."""
