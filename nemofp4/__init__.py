"""nemofp4: pretraining Nemotron-H hybrid Mamba-2/attention models in BF16 and FP4 recipes."""

__version__ = "0.1.0"
