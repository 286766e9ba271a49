"""llama.cpp: everything the project knows about one engine, in one package.

layers.py (the aux-layer id convention: layer inputs), export.py (the draft's GGUF, converted by
llama.cpp's own converter, and reading it back), build.py and install_check.py (the portable
build), server.py (`llama-server` started here), doctor.py and doctor_launch.py (llama.cpp's side of
the serving contract: the folder the converter reads, the GGUF, the launch command). The shared
checks are serving/contract.py; the contract itself docs/contracts.md.
"""
