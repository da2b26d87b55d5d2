"""The validate stage, the product's gate: every artifact against the original model in float64.

- ``tolerance``: the rule and its metrics (one rule for convert, validate and verify);
- ``reference``: the float64 reference of the original eager model;
- ``grid``: the shape grid (and what each artifact's signature says about its dynamic dims);
- ``validation``: running every candidate on the samples and the grid and judging it;
- ``locate``, ``locate_program``, ``module_checks``: naming the first module that diverges.

Nothing is imported here: ``exporter.numerics.tolerance`` stays as light as its own imports.
"""
