"""A run on disk: its log directory, its checkpoints in either format, and the models scripts read out of them."""
