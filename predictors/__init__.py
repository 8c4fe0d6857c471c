"""Built-in hotness predictors, registered through the ``cachelab.predictors`` entry points."""
