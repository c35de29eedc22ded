"""A run: the root config, one visit's loop and its resumable state, the run directory's lock and
state, provenance, and the `preinfer plan` report of a whole config."""
