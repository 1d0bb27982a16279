"""Jobs run inside the processes `dreamp2p.devtools.launch` starts: averaging checks, model state, training."""
