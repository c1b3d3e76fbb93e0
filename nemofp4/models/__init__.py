"""nemofp4.models"""
