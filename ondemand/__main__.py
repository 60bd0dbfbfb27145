import os
import sys

if sys.argv[1:2] == ["sim-engine"]:
    # The engine simulator runs once per engine start of the demo and the tests, so it skips the
    # command line's imports, and the CA store aiohttp loads at import (a simulator never dials out
    # over TLS): together about a third of its start-up CPU.
    os.environ.setdefault("SSL_CERT_FILE", os.devnull)
    os.environ.setdefault("SSL_CERT_DIR", os.devnull)
    from .sim.engine import main as sim_main

    sys.exit(sim_main(sys.argv[2:]))

from .cli import main

sys.exit(main())
