"""What runs a node as a process: the daemon, its checkpoints, metrics and tasks."""
