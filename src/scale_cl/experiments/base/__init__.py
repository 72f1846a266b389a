"""A clean English base model built here from scratch: a small Llama with nothing to repair, so forgetting is real."""
