"""The policies (TokenPilot, SLOMax, FleetMind, baselines) and their controllers."""
