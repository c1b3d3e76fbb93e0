"""nemofp4.training"""
