"""Demo builders: the warm-start recipes of the shipped models and their measurements.

`asyncrl.demos.warm_start` rebuilds the addition demo's policy (``asyncrl/models/tiny_arith/``,
``scripts/make_default_model.py``), `asyncrl.demos.calculator` the calculator task's
(``asyncrl/models/tiny_calc/``, ``scripts/make_calculator_model.py``) and measures it through the
real agent loop on the built-in engine. They sit on top: they import the tasks, the agent loop
and the engines, and nothing of the library imports them (tests/unit/test_layering.py).
"""
