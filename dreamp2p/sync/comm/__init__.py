"""How a round reaches the network: the comm thread or process, the in-process hub, a region's ranks."""
