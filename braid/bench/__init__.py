"""Serving benchmarks: datasets, the open-loop load generator (loadgen), metrics as pure
functions of recorded timings (metrics, server_metrics), `braid bench serve` (serve, report)
and the mode sweep (sweep, sweep_report, server_process)."""
