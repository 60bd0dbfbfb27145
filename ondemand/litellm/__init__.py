"""LiteLLM: its admin API's client and entries, and the sync that keeps them true."""
