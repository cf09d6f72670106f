"""cembed.probe.search."""
