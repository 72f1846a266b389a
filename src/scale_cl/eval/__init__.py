"""Evaluation metrics."""

from scale_cl.eval.first_token import QAExample, first_token_accuracy

__all__ = ["QAExample", "first_token_accuracy"]
