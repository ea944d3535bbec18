"""The fork's graph-trainer experiment."""
