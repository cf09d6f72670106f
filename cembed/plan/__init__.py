"""cembed.plan.resolve."""
