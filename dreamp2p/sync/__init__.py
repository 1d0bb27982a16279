"""The torch side: layer groups, profiling, the comm thread, and the synchronization strategies."""
