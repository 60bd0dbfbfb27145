"""The engine simulator (not a real engine): vLLM's and llama.cpp's routes for demos and
tests, in ``engine`` (``python -m ondemand.sim.engine``, or ``ondemand sim-engine``).

Kept to this one function, which imports ``engine`` only when called, so that running
``ondemand.sim.engine`` as ``__main__`` imports it once.
"""
import os


def main(argv: list[str]) -> int:
    """The simulator as a program of its own (``python -m ondemand sim-engine``, which skips the
    command line's imports). It never dials out over TLS, so the CA store that aiohttp loads at
    import is not read, even where the environment names one (images that set SSL_CERT_FILE for
    their tools): with the skipped imports, about a fifth of each simulator start's CPU, which
    is most of the test suite's."""
    os.environ["SSL_CERT_FILE"] = os.environ["SSL_CERT_DIR"] = os.devnull
    from . import engine

    return engine.main(argv)
