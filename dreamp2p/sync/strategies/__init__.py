"""The synchronization strategies (DreamDDP and the baselines) and the state they keep between rounds."""
