"""cembed.cli.app."""
