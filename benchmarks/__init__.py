"""megacache's benchmarks: each module of this package answers one question (`main(argv)`
runs it), `python -m benchmarks --list` names them, `python -m benchmarks NAME` runs one.
What they share with the tests (machines, servers, models, the training jobs) is
`benchmarks.harness`; docs/benchmarks.md says what the figures mean."""
