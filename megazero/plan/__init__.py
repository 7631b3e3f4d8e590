"""Planning a run before it starts: the memory estimator, the roofline, the layout search and the dry run (one
real step per rank role on the meta device, its short-count fast path and its cache).

Planning imports the runtime to run it on meta; the runtime never imports planning."""

__all__: list[str] = []
