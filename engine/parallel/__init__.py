"""engine.parallel"""
