"""cembed.eval."""
