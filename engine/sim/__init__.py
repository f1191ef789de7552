"""engine.sim"""
