"""The replay: a trace of requests run against a box's deployments on a virtual clock, through
ondemand's own decision code, once per policy (``ondemand replay``)."""
