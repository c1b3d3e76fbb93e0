"""nemofp4.cli"""
