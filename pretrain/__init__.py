"""Pretraining: models, data, per-module strategies, the training loop and comparisons."""
