"""`bench chaos`: real node daemons trained through kills, rejoins and link flaps (the run, its plan, its processes)."""
