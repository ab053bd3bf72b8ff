"""fake"""
