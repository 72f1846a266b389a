"""``scale-cl sweep``: learning-rate sweeps and their stability-plasticity landscape (paper Fig. 2)."""
