"""DC choice: which data center runs a request (FleetMind and the baselines)."""
