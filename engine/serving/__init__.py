"""engine.serving"""
