"""`bench memory`: the host and device bytes per parameter each strategy adds to a one-rank member."""
