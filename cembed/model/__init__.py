"""cembed.model.load."""
