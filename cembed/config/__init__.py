"""cembed.config.schema."""
