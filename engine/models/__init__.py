"""engine.models"""
