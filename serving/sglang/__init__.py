"""SGLang: everything the project knows about one engine, in one package.

layers.py (the aux-layer id convention, before and since PR #25454), loader.py (a model of SGLang's
weight loader), export.py (the draft folder SGLang loads: writer, check, loader), server.py (baseline
and speculative command lines) and doctor.py (SGLang's side of the serving contract). The shared
checks are serving/contract.py; the contract itself docs/contracts.md.
"""
