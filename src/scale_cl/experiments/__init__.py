"""The experiments built on the tuner: the biography benchmark, continual pre-training, matched-learning sweeps.

They use `scale_cl` (the core) and `scale_cl.methods`; nothing in the core imports them.
"""
