"""The ``pagedserve`` command line: one thin module per command over the library's code."""
