"""The soak's parts (scripts/soak.py is its entry point): the plan, the run's state, the clients,
what is watched, the faults, and the checks (the views, the audit rows, the engines' journal).
What the soak shares with the crash test (the ondemand process, /proc, the state file) is
scripts/soaklib.py."""
