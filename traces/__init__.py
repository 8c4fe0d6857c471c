"""Built-in trace producers (corpora, arrival sources, importers), registered through the ``cachelab.workloads`` entry points."""
