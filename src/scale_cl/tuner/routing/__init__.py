"""SCALE-Route's routing: its state on a model, Eq. 5 and the likelihood router (docs/design.md §3)."""
