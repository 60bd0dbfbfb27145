"""What the benchmarks share (scripts/bench.py, bench_cold.py, bench_wake.py, bench_phases.py, each
a short entry point): their subprocesses (procs), the readings of /proc and the statistics
(measure), the load (load), a gateway of their own (gateway), the results file's sections
(results); and the parts of the proxy benchmark (proxy, others, streams, proxy_report)."""
