"""The training techniques, above the models: one module each."""
