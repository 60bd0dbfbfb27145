"""The engine simulator (not a real engine): vLLM's and llama.cpp's routes for demos and
tests, in ``engine`` (``python -m ondemand.sim.engine``, or ``ondemand sim-engine``).

Kept empty so that running ``ondemand.sim.engine`` as ``__main__`` imports it once.
"""
