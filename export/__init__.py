"""glance_rt.export: filled in by the export issue (see README)."""
