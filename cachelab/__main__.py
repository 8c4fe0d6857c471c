"""``python -m cachelab``: the same command line as ``cachelab`` (and ``python -m cachelab.cli``)."""

from cachelab.cli import main

main()
