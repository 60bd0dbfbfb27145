"""The engine simulator (not a real engine): vLLM's and llama.cpp's routes for demos and
tests, in ``engine`` (``python -m ondemand.sim.engine``, or ``ondemand sim-engine``).

Kept to this one function, which imports ``engine`` only when called, so that running
``ondemand.sim.engine`` as ``__main__`` imports it once.
"""


def main(argv: list[str]) -> int:
    """The simulator as a program of its own (``python -m ondemand sim-engine``, which skips the
    command line's imports). It serves on ondemand's lean front and imports no aiohttp (nor
    yarl, attrs, or a CA store): a simulator's start is most of the test suite's CPU
    (``tests/sim/test_sim_lean.py`` keeps it so)."""
    from . import engine

    return engine.main(argv)
