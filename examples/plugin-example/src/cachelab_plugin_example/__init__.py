"""An example cachelab plug-in: a policy and a predictor registered through entry points."""
