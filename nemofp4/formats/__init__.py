"""Minifloat formats, rounding and block scaling. Depends on torch alone."""
