"""Continual pre-training with learning and forgetting measured (paper Fig. 4, 9): `scale-cl cpt`."""
