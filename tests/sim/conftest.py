"""The fixture the engine simulator's tests share (the helpers they share: sim_helpers.py)."""
import pytest
from sim_helpers import simulator


@pytest.fixture
async def sim():
    """A simulator with the default options, serving ``demo``: an aiohttp session at its URL."""
    async with simulator() as session:
        yield session
