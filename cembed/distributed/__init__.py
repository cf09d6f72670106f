"""cembed.distributed.group."""
