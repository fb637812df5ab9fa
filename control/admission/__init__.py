"""Admission: dispatch a request now, hold it in its class's pool, or reject it early."""
