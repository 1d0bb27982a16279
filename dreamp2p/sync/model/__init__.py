"""The model side of synchronization: layer groups, their profiles, round group ids, the optimizer facade."""
