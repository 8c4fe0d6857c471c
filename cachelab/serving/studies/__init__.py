"""Studies: one command each, reproducing a published result from the model's parameters."""
