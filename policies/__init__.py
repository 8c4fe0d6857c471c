"""Built-in cache policies, one subpackage per family, registered through the ``cachelab.policies`` entry points."""
