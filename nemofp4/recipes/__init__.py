"""nemofp4.recipes"""
