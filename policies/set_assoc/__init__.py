"""Set-associative caches, as GPU embedding libraries build them."""
