"""cembed.train.recipe."""
