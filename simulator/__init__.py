"""pipescope's simulator: schedule IR, generators, cost and memory models, the SimPy engine.

Importing this package imports nothing heavy: the IR needs only the standard library.
"""

__version__ = "0.1.0"
