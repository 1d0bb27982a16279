"""The torch side of synchronization, in three rooms that import one way: ``strategies`` (what each step
syncs) -> ``comm`` (how a round reaches the network) -> ``model`` (layer groups, profiles, group ids)."""
