"""Engines: the deployer (the only writer of deployment rows and states), how engines run
(recipes, checkpoints, warmth's rules), the backends under it, and the engine-metrics sampler."""
