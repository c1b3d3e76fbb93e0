"""nemofp4.data"""
