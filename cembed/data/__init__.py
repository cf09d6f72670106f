"""cembed.data.prepare."""
