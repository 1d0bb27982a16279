"""`bench chaos`: real node daemons trained through kills, freezes, partitions and link flaps (the run, its plan,
its processes, the faults' injection, the report)."""
