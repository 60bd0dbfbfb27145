import sys

if sys.argv[1:2] == ["sim-engine"]:
    # The engine simulator runs once per engine start of the demo and the tests: straight to it.
    from .sim import main as sim_main

    sys.exit(sim_main(sys.argv[2:]))

from .cli import main

sys.exit(main())
