"""The embedded default model: a tiny streaming VAE + causal DiT trained here, on CPU, to stylise video.

Modules: ``clips`` (synthetic camera-like training clips), ``teachers`` (deterministic style filters),
``styles`` (style registry, prompt phrasings, prompt -> nearest style), ``train`` (the recipe),
``model`` (load the shipped checkpoint and stylise a stream), ``evaluate`` (fidelity, stability, speed).
"""
