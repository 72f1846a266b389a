"""HF Trainer glue shared by the experiments."""
