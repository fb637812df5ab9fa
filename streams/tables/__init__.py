"""The table logic: pure aggregations over lifecycle, telemetry and KV events.

``TableBuilder`` is the whole of it in one object, fed decoded events in any order; the
embedded mode runs it directly and the Faust app (``streams.faust_app``) hosts the same
pieces with its tables as the state store.
"""
