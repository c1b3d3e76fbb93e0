"""Nemotron-H hybrid Mamba-2 / attention model."""
