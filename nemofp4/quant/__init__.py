"""nemofp4.quant"""
