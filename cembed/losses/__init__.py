"""cembed.losses.registry."""
