"""The subcommands of ``tokenfleet``, one module per area; each has ``register``."""
