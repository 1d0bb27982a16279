"""`bench regions`: WAN goodput of many-rank regions over tbf-shaped links (the run, its network, one rank)."""
