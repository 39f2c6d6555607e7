"""glance_rt.engines: filled in by the engines issue (see README)."""
