"""Component benchmarks, research studies (studies/) and rehearsals (rehearsals/), each run as a module from the repo root: `python -m benchmarks.NAME`."""
