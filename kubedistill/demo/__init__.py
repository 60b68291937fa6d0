"""Demo models, tasks and data: the quickstart's and the examples' tiny teachers and students, the
arithmetic and dot-counting tasks.

Nothing in the runtime image imports it (tests/test_product_boundary.py): the `quickstart` and
`prepare-vl` commands load it only when they run.
"""
