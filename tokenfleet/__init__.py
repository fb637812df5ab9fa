"""The ``tokenfleet`` command line, fleet configuration and the embedded demo's wiring."""
