"""The biography benchmark (paper Fig. 8): `scale-cl bio`."""
