"""Serving: everything that knows an engine's formats, flags, HTTP and processes.

One package per engine (sglang/, vllm/, llamacpp/: layer ids, export writer, server and launch,
doctor checks; a new engine is one new package plus its line in doctor/run.py), the draft folder
format (draft_folder.py), the one serving-contract validator (contract.py, called by export and the
doctor), the doctor (doctor/), cross-engine launch commands (launch.py), processes (process.py),
the HTTP client (client.py) and the benchmarks' serving side (bench/). See docs/contracts.md.
"""
