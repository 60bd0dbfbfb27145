"""What the replay's scripts share (replay_bench.py, replay_bounds.py, replay_rhythms.py, each a
short entry point): the box mix, its traces and boxes (mix), and the Markdown they write into
bench/replay.md (markdown). Their tables' words and pictures are replay_front.py's and
replay_pareto.py's."""
