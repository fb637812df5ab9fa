"""The reconcile loops: from the tables to the control snapshots the gateways apply."""
