"""vLLM: everything the project knows about one engine, in one package.

layers.py (the aux-layer id convention, for serving and extraction), export.py (the speculators
folder vLLM loads: writer, check, loader), server.py (serving with our draft or its n-gram method,
the baseline command line, what vLLM says it loaded), extract_server.py and plugin/ (the
hidden-states server for extraction), doctor.py and doctor_live.py (vLLM's side of the serving
contract). The shared checks are serving/contract.py; the contract itself docs/contracts.md.
"""
