"""The parts of benchmarks/server_bench.py, one job each; server_bench.py composes them.

- wire.py      the raw HTTP/RESP client: connect, send a file, frame a response head
- services.py  the servers under test (ours, nginx, redis) and their CPU accounting
- fixtures.py  the random blob files and the entry every target serves
- measure.py   what every measurement shares: the tally, interleaved repeats, settling
- gets.py      the blob GET load generator (one process per core, bodies dropped in the
               kernel) and the GET job
- puts.py      the PUT uploaders and the PUT job
- lookups.py   entry lookup latency with wrk
- report.py    goals, tables, chart and the server section of RESULTS.md
"""
