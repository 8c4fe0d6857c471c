"""``python -m cachelab.cli``: the same command line as ``cachelab``."""

from cachelab.cli import main

main()
