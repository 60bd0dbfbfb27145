"""The HTTP layer: one stack per connection (design.md, "The HTTP layer").

- ``limits``: the one frozen :class:`Limits`, used by both stacks;
- ``protocol`` and ``cycle``: the lean front, a connection and its per-request :class:`Call`;
- ``flow_control``: pausing reads past a high-water mark, waiting for writes to drain;
- ``aio``: a connection handed to aiohttp's application, once and for good;
- ``server``: the listeners, the hand-off's factory and the shutdown;
- ``refusals``: the server's own refusals, in the documented JSON;
- ``pool``: the engines' connection pools, on httptools' response parser.
"""
from .cycle import BodyMalformed, BodyTooLarge, Call
from .limits import Limits

__all__ = ["BodyMalformed", "BodyTooLarge", "Call", "Limits"]
