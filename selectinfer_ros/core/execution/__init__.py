"""Running the model: the lean decoder (prefill, one token), generation and choices, metrics."""
