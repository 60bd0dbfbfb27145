"""ondemand: the on-demand gateway for LLM deployments on a DGX box."""

__version__ = "0.1.0"
